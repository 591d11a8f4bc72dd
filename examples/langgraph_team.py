"""A LangGraph research team on contextkit serve: workers fan out with ``Send``, each an ordinary
``ChatOpenAI`` call that asks serve to keep its answer's KV; the fan-in node is the synthesizer, which
carries the workers' notes as text (as any LangGraph state does) and names their response ids, so serve
reads the notes from their kept KV instead of prefilling them again.

    python examples/langgraph_team.py                                  # starts serve here, embedded model
    python examples/langgraph_team.py --url http://localhost:8000 --api-key KEY   # a running contextkit serve

Needs: pip install 'contextkit[local]' langgraph langchain-openai. Nothing here is contextkit-specific
but two ``extra_body`` fields: ``{"contextkit": {"keep": true}}`` on a worker and
``{"contextkit": {"handles": [...]}}`` on the synthesizer (``"auto"`` finds them without the ids).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
from pathlib import Path
from typing import Annotated, TypedDict

import httpx
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send

HERE = Path(__file__).resolve().parent


class Team(TypedDict):
    question: str
    passages: list[str]
    notes: Annotated[list[tuple[str, str]], operator.add]  # (note, response id) per worker, merged by fan-in
    answer: str
    usage: dict | None


class Task(TypedDict):
    question: str
    passage: str


def build(llm: ChatOpenAI):
    def fan_out(state: Team) -> list[Send]:
        return [Send("worker", {"question": state["question"], "passage": p}) for p in state["passages"]]

    def worker(task: Task) -> dict:
        msg = llm.invoke([SystemMessage(f"You are a research worker. Question: {task['question']}\n"
                                        "Write one short note with what your passage says about it."),
                          HumanMessage(task["passage"])],
                         extra_body={"contextkit": {"keep": True}})
        return {"notes": [(msg.content, msg.response_metadata["id"])]}

    def synthesizer(state: Team) -> dict:
        notes = "\n\n".join(f"Note {i + 1}:\n{text}" for i, (text, _) in enumerate(state["notes"]))
        msg = llm.invoke([SystemMessage("You combine your workers' notes into one short answer."),
                          HumanMessage(f"{notes}\n\nQuestion: {state['question']}\nAnswer:")],
                         extra_body={"contextkit": {"handles": [rid for _, rid in state["notes"]]}})
        return {"answer": msg.content, "usage": msg.response_metadata.get("token_usage")}

    graph = StateGraph(Team)
    graph.add_node("worker", worker)
    graph.add_node("synthesizer", synthesizer)
    graph.add_conditional_edges(START, fan_out, ["worker"])
    graph.add_edge("worker", "synthesizer")
    graph.add_edge("synthesizer", END)
    return graph.compile()


def kv_reads(url: str, key: str | None) -> float:
    """Handles serve has read from kept KV so far (its /metrics)."""
    text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"} if key else {}).text
    line = next((ln for ln in text.splitlines() if ln.startswith('contextkit_serve_handle_reads_total{read="kv"}')), "")
    return float(line.split()[-1]) if line else 0.0


@contextlib.contextmanager
def server(url: str | None):
    if url:
        yield url
        return
    from contextkit import ContextKit
    from contextkit.integrations.launchers.inprocess import AppThread
    from contextkit.integrations.serve.app import create_serve_app

    with ContextKit() as kit, AppThread(create_serve_app(kit, "contextkit")) as s:
        yield s.url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running contextkit serve (default: start one here)")
    ap.add_argument("--api-key", default=None)
    args = ap.parse_args()
    ex = json.loads((HERE / "question.json").read_text())
    with server(args.url) as url:
        llm = ChatOpenAI(base_url=url + "/v1", api_key=args.api_key or "none", model="contextkit", temperature=0,
                         max_tokens=48, max_retries=0)
        before = kv_reads(url, args.api_key)
        out = build(llm).invoke({"question": ex["question"], "passages": [d["text"] for d in ex["documents"]],
                                 "notes": [], "answer": "", "usage": None})
        for i, (note, rid) in enumerate(out["notes"]):
            print(f"worker {i + 1} ({rid}): {note.strip()!r}")
        print(f"answer: {out['answer'].strip()!r}")
        read = kv_reads(url, args.api_key) - before
        prompt = (out["usage"] or {}).get("prompt_tokens")
        print(f"\n[{len(out['notes'])} notes, {read:.0f} read from kept KV; {prompt} prompt tokens in the synthesis]")


if __name__ == "__main__":
    main()
