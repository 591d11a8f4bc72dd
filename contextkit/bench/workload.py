"""A seeded RAG request stream with the sharing real sessions have, and its replayable trace format.

How the stream is built (``generate``), all from a multihop-shaped file and one seed:
- Topics are the file's questions, in a seeded random popularity order; a session picks its topic with a
  Zipf law (weight 1/rank^s, ``zipf_s``), so popular topics, and their documents, recur across
  sessions and tenants.
- A session asks the topic's question, then more turns (geometric, mean ``mean_followups``) that refine
  the same information need with one of the topic's entities, the way a user narrows a search: the
  retrieval query is the question plus a passage title, the prompt asks the question again. A follow-up's
  top-k overlaps the first turn's, ranked differently; that is the reuse ordering can recover, and since
  every turn keeps the gold answers, answer quality is scored on exactly the reordered requests.
- Up to ``active_sessions`` sessions are open at once and their turns interleave in arrival order.
- Each session belongs to one of ``tenants`` tenants. Every request retrieves its top-``k`` from the
  whole passage pool with real dense retrieval (``bench.retrieval``).

Trace format (``--trace`` / ``--write-trace``), one JSON object per line, in arrival order:
``{"id", "session", "tenant", "question", "answers": [..], "documents": [{"id", "title", "text"}, ...]}``
with ``documents`` in retrieval order (the retriever's ranking; the baseline policy keeps it). Any query
log converted to this shape replays through ``contextkit bench ordering --trace FILE``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from contextkit.core.errors import ConfigError, InputError


@dataclass(frozen=True, slots=True)
class TraceDoc:
    id: str
    title: str
    text: str


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    session: str
    tenant: str
    question: str
    answers: tuple[str, ...]
    documents: tuple[TraceDoc, ...]  # retrieval order


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int = 200
    k: int = 10
    zipf_s: float = 1.1
    mean_followups: float = 2.0
    active_sessions: int = 4
    tenants: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.k < 1 or self.tenants < 1 or self.active_sessions < 1:
            raise ConfigError("requests, k, tenants and active_sessions must be >= 1")
        if self.zipf_s < 0 or self.mean_followups < 0:
            raise ConfigError("zipf_s and mean_followups must be >= 0")


def _turns(record, rng: random.Random, mean_followups: float) -> list[tuple[str, str, tuple[str, ...]]]:
    """(prompt question, retrieval query, answers) for each turn of one session."""
    turns = [(record.question, record.question, tuple(record.answers))]
    p_stop = 1.0 / (1.0 + mean_followups)  # geometric number of follow-ups with this mean
    titles = [p.title for p in record.passages if p.title]
    rng.shuffle(titles)
    for title in titles:
        if rng.random() < p_stop:
            break
        turns.append((record.question, f"{record.question} {title}", tuple(record.answers)))
    return turns


def generate(records: Sequence, retriever, spec: WorkloadSpec) -> list[TraceRequest]:
    """The request stream for ``records`` (``bench.data.QARecord``) retrieved with ``retriever``."""
    if not records:
        raise InputError("no records to build a workload from")
    rng = random.Random(spec.seed)
    topics = list(records)
    rng.shuffle(topics)
    weights = [1.0 / (rank + 1) ** spec.zipf_s for rank in range(len(topics))]
    plans: list[tuple[str, str, str, str, tuple[str, ...]]] = []  # session, tenant, question, query, answers
    active: list[tuple[str, str, list]] = []
    n_sessions = 0
    while len(plans) < spec.requests:
        while len(active) < spec.active_sessions:
            topic = rng.choices(topics, weights)[0]
            tenant = f"tenant-{rng.randrange(spec.tenants)}"
            active.append((f"s{n_sessions}", tenant, _turns(topic, rng, spec.mean_followups)))
            n_sessions += 1
        i = rng.randrange(len(active))
        session, tenant, turns = active[i]
        question, query, answers = turns.pop(0)
        plans.append((session, tenant, question, query, answers))
        if not turns:
            active.pop(i)
    hits = retriever.search([p[3] for p in plans], spec.k)
    return [
        TraceRequest(
            id=f"r{n}", session=session, tenant=tenant, question=question, answers=answers,
            documents=tuple(TraceDoc(p.id, p.title, p.text) for p in docs),
        )  # fmt: skip
        for n, ((session, tenant, question, _, answers), docs) in enumerate(zip(plans, hits))
    ]


def write_trace(requests: Sequence[TraceRequest], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r), ensure_ascii=False) + "\n")


def read_trace(path: Path) -> list[TraceRequest]:
    """Requests of a trace file; a malformed line is an ``InputError`` naming the line and the fix."""
    if not path.is_file():
        raise InputError(f"trace {path} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            o = json.loads(line)
            docs = o["documents"]
            if not isinstance(docs, list):
                raise TypeError("documents is not a list")
            out.append(TraceRequest(
                id=str(o.get("id", f"r{n}")), session=str(o.get("session", "")), tenant=str(o.get("tenant", "")),
                question=str(o["question"]), answers=tuple(o.get("answers") or ()),
                documents=tuple(TraceDoc(str(d.get("id") or _doc_id(d)), str(d.get("title") or ""), str(d["text"]))
                                for d in docs),
            ))  # fmt: skip
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(
                f"{path}:{n}: expected {{id, session, tenant, question, answers, documents: [{{id, title, text}}]}}"
                f" ({type(exc).__name__}: {exc}); fix or remove that line"
            ) from exc
    if not out:
        raise InputError(f"trace {path} holds no requests")
    return out


def _doc_id(d: dict) -> str:
    from contextkit.bench.retrieval import passage_id

    return passage_id(str(d.get("title") or ""), str(d["text"]))
