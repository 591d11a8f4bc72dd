"""A LlamaIndex query engine on contextkit: a faiss retriever over multi-hop passages, the reorder node
postprocessor, and the contextkit LLM that receives the retrieved nodes as documents.

    python examples/llamaindex_query.py                   # in process, the embedded default model
    python examples/llamaindex_query.py --url http://localhost:8000 --api-key KEY

Needs the extras: pip install 'contextkit[llamaindex,retrieval]'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import contextkit
from contextkit.integrations.frameworks.llamaindex import (
    ContextKitLLM,
    ContextKitQueryEngine,
    ContextKitReorderPostprocessor,
    EvidenceRetriever,
)  # fmt: skip
from contextkit.synthesis.embed import Embedder, VectorIndex

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data" / "multihop_dev.jsonl"


def load(path: Path, n: int) -> tuple[list[str], list[contextkit.Evidence]]:
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()[:n]]
    else:
        ex = json.loads((HERE / "question.json").read_text())
        rows = [{"question": ex["question"], "passages": ex["documents"]}]
    passages = {}
    for r in rows:
        for p in r["passages"]:
            passages.setdefault((p.get("title"), p["text"]), None)
    return [r["question"] for r in rows], [contextkit.Evidence(t, id=f"p{i}", title=title)
                                           for i, (title, t) in enumerate(passages)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url"), ap.add_argument("--api-key"), ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--questions", type=int, default=2)
    args = ap.parse_args()
    questions, passages = load(args.data, 20)
    embed = Embedder()
    index = VectorIndex(embed([f"{p.title}\n{p.text}" for p in passages]))

    def search(query: str, k: int = 4) -> list[contextkit.Evidence]:
        _, idx = index.search(embed([query]), k)
        return [passages[i] for i in idx[0] if i >= 0]

    client = contextkit.connect(args.url, args.api_key)
    engine = ContextKitQueryEngine(retriever=EvidenceRetriever(search), llm=ContextKitLLM(client=client, max_tokens=24),
                                   node_postprocessors=[ContextKitReorderPostprocessor()])
    for q in questions[: args.questions] + questions[:1]:
        resp = engine.query(q)
        r = resp.metadata["contextkit"]
        print(f"Q: {q}\nA: {resp.response.strip()}  (from {len(resp.source_nodes)} nodes)")
        print(f"[{r['prompt_tokens']} prompt tokens: {r['reused_tokens']} reused ({r['cached_tokens']} already "
              f"cached), {r['recomputed_tokens']} recomputed, {r['prefilled_tokens']} prefilled; "
              f"TTFT {resp.metadata['ttft_ms']:.0f} ms]")
    client.close()


if __name__ == "__main__":
    main()
