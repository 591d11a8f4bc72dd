"""The ordering workload: real MiniLM + faiss retrieval, seeded sessions that share documents, traces."""

from __future__ import annotations

import json

import pytest

from contextkit.bench.data import load_records
from contextkit.bench.retrieval import Retriever, passage_pool
from contextkit.bench.workload import WorkloadSpec, generate, read_trace, write_trace
from contextkit.core.errors import ConfigError, InputError

pytestmark = pytest.mark.slow  # every test loads the MiniLM embedder and builds a faiss index


@pytest.fixture(scope="module")
def small(tmp_path_factory, shared_data):
    path = shared_data / "multihop_dev.jsonl"
    if not path.is_file():
        pytest.skip("needs ../shared/data/multihop_dev.jsonl")
    records = load_records(path)[:12]
    cache = tmp_path_factory.mktemp("cache")
    return records, Retriever(passage_pool(records), cache), cache


def test_retrieval_finds_the_question_own_passages(small):
    records, retriever, cache = small
    hits = retriever.search([r.question for r in records], k=10)
    own = [len({p.text for p in h} & {p.text for p in r.passages}) / 10 for r, h in zip(records, hits)]
    assert sum(own) / len(own) > 0.5  # mostly the item's own passages among 120 in the pool
    assert list((cache / "embeddings").glob("*.npy"))  # embeddings cached, atomically named
    again = Retriever(retriever.passages, cache)  # loads the cache, same index
    assert [p.id for p in again.search([records[0].question], 5)[0]] == [p.id for p in hits[0][:5]]


def test_stream_is_seeded_and_sessions_share_documents(small):
    records, retriever, _ = small
    spec = WorkloadSpec(requests=40, k=8, seed=3)
    a, b = generate(records, retriever, spec), generate(records, retriever, spec)
    assert a == b and len(a) == 40
    assert generate(records, retriever, WorkloadSpec(requests=40, k=8, seed=4)) != a
    by_session: dict[str, list] = {}
    for r in a:
        assert len(r.documents) == 8 and len({d.id for d in r.documents}) == 8
        by_session.setdefault(r.session, []).append(r)
    follow = [(s[0], t) for s in by_session.values() for t in s[1:]]
    assert follow, "expected follow-up turns"
    overlap = [len({d.id for d in f.documents} & {d.id for d in t.documents}) for f, t in follow]
    assert sum(overlap) / len(overlap) >= 4  # follow-ups retrieve much of the first turn's set...
    assert any([d.id for d in f.documents] != [d.id for d in t.documents] for f, t in follow)  # ...reranked
    assert all(r.answers for r in a)  # every turn keeps its topic's gold answers: F1 is scored on reordered ones too
    assert {r.tenant for r in a} <= {"tenant-0", "tenant-1"}


def test_trace_round_trip_and_errors(small, tmp_path):
    records, retriever, _ = small
    stream = generate(records, retriever, WorkloadSpec(requests=10, k=4, seed=1))
    path = tmp_path / "t.jsonl"
    write_trace(stream, path)
    assert read_trace(path) == stream
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"id", "session", "tenant", "question", "answers", "documents"}
    assert set(first["documents"][0]) == {"id", "title", "text"}
    no_id = tmp_path / "noid.jsonl"  # documents without ids get content ids: same text, same id
    no_id.write_text(json.dumps({"question": "q", "documents": [{"text": "x"}, {"title": "t", "text": "x"}]}) + "\n")
    docs = read_trace(no_id)[0].documents
    assert docs[0].id != docs[1].id and read_trace(no_id)[0].documents[0].id == docs[0].id
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "documents": [{"title": "no text"}]}\n')
    with pytest.raises(InputError, match="bad.jsonl:1"):
        read_trace(bad)
    with pytest.raises(InputError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ConfigError):
        WorkloadSpec(requests=0)
