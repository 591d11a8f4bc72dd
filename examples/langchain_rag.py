"""A LangChain RAG chain on contextkit: a faiss retriever over multi-hop passages, the reorder compressor,
and the contextkit chat model that receives the passages as documents (reused KV, not prompt text).

    python examples/langchain_rag.py                      # in process, the embedded default model
    python examples/langchain_rag.py --url http://localhost:8000 --api-key KEY   # contextkit serve / proxy

Needs the extras: pip install 'contextkit[langchain,retrieval]'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda

import contextkit
from contextkit.integrations.frameworks.langchain import ChatContextKit, ContextKitReorder, EvidenceRetriever
from contextkit.synthesis.embed import Embedder, VectorIndex

HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data" / "multihop_dev.jsonl"  # the repository's data, when beside it


def load(path: Path, n: int) -> tuple[list[str], list[contextkit.Evidence]]:
    """Questions and their distinct passages (the bundled example when the data file is absent)."""
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
    llm = ChatContextKit(client=client, max_tokens=24)
    retriever, reorder = EvidenceRetriever(search=search), ContextKitReorder()
    prompt = ChatPromptTemplate.from_messages([("system", "Answer briefly, in a few words."), ("human", "{question}")])
    chain = (
        RunnableLambda(lambda q: {"question": q, "docs": reorder.compress_documents(retriever.invoke(q), q)})
        | RunnableLambda(lambda x: llm.invoke(prompt.invoke({"question": x["question"]}), documents=x["docs"]))
    )
    for q in questions[: args.questions] + questions[:1]:  # the first question again: its passages are cached
        msg = chain.invoke(q)
        r = msg.response_metadata["contextkit"]
        print(f"Q: {q}\nA: {msg.content.strip()}")
        print(f"[{r['prompt_tokens']} prompt tokens: {r['reused_tokens']} reused ({r['cached_tokens']} already "
              f"cached), {r['recomputed_tokens']} recomputed, {r['prefilled_tokens']} prefilled; "
              f"TTFT {msg.response_metadata['ttft_ms']:.0f} ms]")
    client.close()


if __name__ == "__main__":
    main()
