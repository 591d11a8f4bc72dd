"""Answer a question over a few documents with the Python API, streaming the answer.

    python examples/answer.py "Which engineer is the Eiffel Tower named after?"
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from contextkit import ContextKit, ContextKitConfig, Evidence, SamplingParams


def main() -> None:
    example = json.loads((Path(__file__).parent / "question.json").read_text())
    question = sys.argv[1] if len(sys.argv) > 1 else example["question"]
    documents = [Evidence(text=d["text"], title=d.get("title")) for d in example["documents"]]

    kit = ContextKit(ContextKitConfig())  # SmolLM2-135M-Instruct, prepared on first use
    stream = kit.stream(question, documents, params=SamplingParams(max_new_tokens=64))
    for delta in stream:
        print(delta, end="", flush=True)
    result = stream.result
    print(f"\n[{result.prompt_tokens} prompt tokens, prefill {result.prefill_ms:.0f} ms, "
          f"{result.decode_ms_per_token:.1f} ms/token]")


if __name__ == "__main__":
    main()
