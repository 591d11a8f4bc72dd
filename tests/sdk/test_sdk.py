"""The SDK: one Client, the same calls and results in process and over HTTP (serve, proxy + vLLM)."""

from __future__ import annotations

import asyncio
import json

import pytest

import contextkit
from contextkit.core.errors import (
    AuthenticationError,
    ConfigError,
    EmptyInputError,
    InputError,
    PermissionDeniedError,
    PromptTooLongError,
    UpstreamError,
)  # fmt: skip
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.types import Evidence, Message
from contextkit.integrations.launchers.process import free_port
from contextkit.sdk.local import LocalTransport
from contextkit.sdk.session import Client


@pytest.fixture(scope="module")
def example(repo):
    ex = json.loads((repo / "examples" / "question.json").read_text())
    return ex["question"], [{"id": f"d{i}", **d} for i, d in enumerate(ex["documents"])]


@pytest.fixture(scope="module")
def local(keyed_serve):
    _, _, kit = keyed_serve
    return Client(LocalTransport(kit))  # the serve test app's kit: one model in memory


@pytest.fixture(scope="module")
def http(keyed_serve):
    url, key, _ = keyed_serve
    with contextkit.connect(url, api_key=key) as c:
        yield c


def test_local_and_serve_send_the_same_prompt_and_report_the_kv_path(local, http, example):
    question, docs = example
    a = local.generate(question, docs, max_tokens=4, tenant=None)
    b = http.generate(question, docs, max_tokens=4)
    assert a.prompt_tokens == b.prompt_tokens > 0  # one planner: the same tokens on both transports
    for ans in (a, b):
        assert ans.report.path == "kv" and ans.report.policy == "query_attention"
        rep = ans.report
        assert rep.reused_tokens + rep.recomputed_tokens + rep.prefilled_tokens == rep.prompt_tokens
        assert sorted(rep.order) == sorted(d["id"] for d in docs)
        assert ans.completion_tokens >= 1 and ans.ttft_ms <= ans.total_ms
    again = http.generate(question, docs[::-1], max_tokens=4)  # the same documents: span hits now
    assert again.report.cached_tokens > 0 and again.report.compiled_tokens == 0


def test_full_prefill_and_explicit_policy_reach_serve(http, example):
    question, docs = example
    full = http.generate(question, docs, max_tokens=2, reuse=False)
    assert full.report.policy == "full" and full.report.reused_tokens == 0
    first_k = http.generate(question, docs, max_tokens=2, reuse=contextkit.ReuseOptions(policy="first_k", first_k=4))
    assert first_k.report.policy == "first_k"


def test_stream_and_async_agree_with_their_answers(http, local, example):
    question, docs = example
    for client in (http, local):
        s = client.stream(question, docs, max_tokens=6)
        text = "".join(s)
        assert s.answer is not None and s.answer.text == text and s.answer.report.path == "kv"
        a = asyncio.run(client.agenerate(question, docs, max_tokens=3))
        assert a.report.path == "kv" and a.completion_tokens >= 1

        async def collect():
            st = client.astream(question, docs, max_tokens=6)
            parts = [d async for d in st]
            return parts, st.answer

        parts, answer = asyncio.run(collect())
        assert "".join(parts) == answer.text and answer.report.prompt_tokens > 0


def test_an_abandoned_local_stream_blocks_nothing(local, example):
    question, docs = example
    s = local.stream(question, docs, max_tokens=8)
    next(iter(s))  # read one delta, then walk away with the stream still referenced
    other = local.stream(question, docs, max_tokens=3)  # a second stream in the same thread, interleaved
    assert local.generate(question, docs, max_tokens=2).completion_tokens >= 1
    assert other.finish().completion_tokens >= 1 and s.finish().completion_tokens >= 1


def test_errors_come_from_the_one_tree(keyed_serve, example):
    url, _, _ = keyed_serve
    question, docs = example
    with contextkit.connect(url, api_key="wrong-key") as c:
        with pytest.raises(AuthenticationError, match="401"):
            c.generate(question, docs, max_tokens=2)
    with contextkit.connect(f"http://127.0.0.1:{free_port()}", api_key="k", timeout_s=5) as c:
        with pytest.raises(UpstreamError, match="cannot reach"):
            c.generate(question, docs, max_tokens=2)
    with contextkit.connect(url, api_key=keyed_serve[1]) as c:
        with pytest.raises(EmptyInputError):
            c.generate(question, [{"text": "  "}])
        with pytest.raises(InputError, match="unknown document fields"):
            c.generate(question, [{"text": "x", "body": "y"}])
        with pytest.raises(PermissionDeniedError, match="403"):  # keys fix the tenant
            c.generate(question, docs, max_tokens=2, tenant="other")
        with pytest.raises(PromptTooLongError, match="413.*context"):  # the server's check, with its message
            c.generate(question, docs, max_tokens=100_000)
    with pytest.raises(InputError, match="http"):
        contextkit.connect("localhost:8000")


def test_a_session_keeps_its_documents_first_so_each_turn_extends_the_last(config, smol_dir):
    """On the planner: turn 2's prompt starts with turn 1's documents (the session layout), so an engine
    with a prefix cache holds everything up to the first new document."""
    from contextkit.core.tokenizer import Tokenizer

    planner = Planner(Tokenizer(smol_dir))
    a, b, c = (Evidence(f"Passage {n}: " + "words " * 40, id=f"p{n}") for n in "abc")
    t1 = planner.plan(ChatRequest((Message("user", "first question?"),), (a, b), documents_at="first"))
    t2 = planner.plan(ChatRequest((Message("user", "first question?"), Message("assistant", "an answer"),
                                   Message("user", "second question?")), (a, b, c), documents_at="first"))
    docs_end = sum(len(it.span.token_ids) for it in t1.items if it.span.kind != "query")
    assert t2.ids[:docs_end] == t1.ids[:docs_end]
    # the default layout puts the documents in the last turn: the second turn shares only the head
    t2_last = planner.plan(ChatRequest((Message("user", "first question?"), Message("assistant", "an answer"),
                                        Message("user", "second question?")), (a, b, c)))
    assert t2_last.ids[:docs_end] != t1.ids[:docs_end]


def test_a_session_over_the_proxy_hits_vllms_prefix_cache_and_skips_known_documents(open_proxy, shared_data, repo,
                                                                                    smol_dir):
    from contextkit.core.tokenizer import Tokenizer

    path = shared_data / "multihop_dev.jsonl"
    if path.is_file():
        rec = json.loads(path.read_text().splitlines()[3])
        passages = [{"id": f"p{i}", "title": p["title"], "text": p["text"]} for i, p in enumerate(rec["passages"][:6])]
        question = rec["question"]
    else:
        ex = json.loads((repo / "examples" / "question.json").read_text())
        passages, question = [{"id": f"p{i}", **d} for i, d in enumerate(ex["documents"])], ex["question"]
    with contextkit.connect(open_proxy) as client:
        s = client.session(tenant="sdk-session-test")
        first = s.ask(question, passages[:3], max_tokens=8)
        second = s.ask("Say that again in other words.", passages[1:], max_tokens=8)
    assert first.report.path == second.report.path == "prompt"
    assert second.report.skipped_documents == tuple(p["id"] for p in passages[1:3])
    assert second.report.order[:3] == first.report.order  # the session's documents stay in place
    assert second.report.prompt_tokens > first.report.prompt_tokens
    # vLLM's own count: turn 2 found turn 1's head and documents in its prefix cache (whole 32-token blocks)
    t1 = Planner(Tokenizer(smol_dir)).plan(ChatRequest((Message("user", question),),
                                                       tuple(Evidence(p["text"], id=p["id"], title=p["title"])
                                                             for p in passages[:3]),
                                                       ordering="retrieval", documents_at="first"))
    assert t1.num_tokens == first.prompt_tokens
    docs_end = sum(len(it.span.token_ids) for it in t1.items if it.span.kind != "query")
    assert second.report.cached_tokens >= docs_end - docs_end % 32
    assert len(s.steps) == 2 and s.messages[-1].role == "assistant"


def test_session_rules(local, example):
    question, docs = example
    s = local.session()
    with pytest.raises(InputError, match="ask first"):
        s.tool("grep", "output")
    s.ask(question, docs[:1], max_tokens=2)
    s.tool("search", "Gustave Eiffel's company built the tower.")
    with pytest.raises(InputError, match="other text"):
        s.ask("again?", [{"id": docs[0]["id"], "text": "different text"}], max_tokens=2)
    a = s.ask("again?", docs, max_tokens=2)
    assert a.report.skipped_documents == (docs[0]["id"],)
    assert [m.role for m in s.messages] == ["user", "assistant", "tool", "user", "assistant"]
    with pytest.raises(ConfigError):
        local.session(documents=docs)


def test_fork_and_join_in_process(local, example):
    question, docs = example
    team = local.fork(f"You are a research worker. Question: {question}\n", ["Note:", "Note:"],
                      documents=[docs[:1], docs[1:2]], max_tokens=12)
    assert len(team.branches) == 2 and all(b.ok and b.token_ids for b in team.branches)
    kv = team.join(f"Combine the notes. Question: {question}\n", max_tokens=6)
    text = team.join_text(f"Combine the notes. Question: {question}\n", max_tokens=6)
    assert kv.report.path == "kv" and kv.report.reused_tokens > 0
    assert text.report.reused_tokens == 0 and text.report.policy == "full"
    assert kv.prompt_tokens == text.prompt_tokens  # the same synthesizer context, read two ways


def test_fork_and_join_over_http(http, example):
    """The same calls against serve: workers are chats that keep their KV, the join names their handles."""
    question, docs = example
    team = http.fork(f"You are a research worker. Question: {question}\n", ["Note:", "Note:"],
                     documents=[docs[:1], docs[1:2]], max_tokens=12)
    assert len(team.branches) == 2 and all(b.ok and b.handle for b in team.branches)
    for transcripts in (False, True):
        kv = team.join(f"Combine the notes. Question: {question}\n", max_tokens=6, transcripts=transcripts)
        text = team.join_text(f"Combine the notes. Question: {question}\n", max_tokens=6, transcripts=transcripts)
        assert [r for _, r in kv.report.handles] == ["kv", "kv"] and kv.report.reused_tokens > 0
        assert [r for _, r in text.report.handles] == ["not_reused"] * 2 and text.report.policy == "full"
        assert kv.prompt_tokens == text.prompt_tokens  # the same synthesizer prompt, read two ways
