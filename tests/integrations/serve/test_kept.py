"""Parallel agents over HTTP on ``contextkit serve`` (issue 47), with the real ``openai`` client: a worker
keeps its answer's KV under its response id; a synthesizer that carries the answer as text and names the
handle reads that KV; a handle that is unknown, another tenant's, dropped or edited costs speed, never the
answer (the text is prefilled: the same prompt and KV path as a request without the handle)."""

from __future__ import annotations

import uuid

import httpx
import openai
import pytest
import torch

from contextkit import ContextKit
from contextkit.core.tenancy import Tenancy
from contextkit.integrations.edge.ratelimit import RateLimit
from contextkit.integrations.serve.app import ServeLimits, create_serve_app
from contextkit.synthesis.handles import KeepLimits, keep_answer

pytestmark = pytest.mark.slow

TASK = "List two facts about the Moon in one short sentence."


def _fresh(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def served(config, app_thread):
    kit = ContextKit(config)
    limits = ServeLimits(rate=RateLimit(), keep=KeepLimits(max_per_request=4))
    with app_thread(create_serve_app(kit, "smol-local", Tenancy(allow_client_tenant=True), limits)) as s:
        yield s, kit, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    kit.close()


def _worker(client, tenant: str, task: str = TASK):
    r = client.chat.completions.create(
        model="smol-local", max_tokens=24, temperature=0,
        messages=[{"role": "system", "content": "You are a research worker."}, {"role": "user", "content": task}],
        extra_body={"contextkit": {"keep": True, "tenant": tenant}})  # fmt: skip
    return r, r.model_extra["contextkit"]["kept"]


def _synth(client, tenant: str, note: str, handle=None, **extra):
    doc = {"title": "Note 1", "text": note} | ({"handle": handle} if handle is not None else {})
    return client.chat.completions.create(
        model="smol-local", max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "You combine your workers' notes."},
                  {"role": "user", "content": "What do the notes say about the Moon?"}],
        extra_body={"documents": [doc], "return_token_ids": True, "contextkit": {"tenant": tenant, **extra}})


def test_a_worker_keeps_its_answer_and_a_synthesizer_reads_it_from_kv(served):
    s, kit, client = served
    tenant = _fresh("team")
    worker, kept = _worker(client, tenant)
    assert kept["handle"] == worker.id and kept["tokens"] > 0
    note = worker.choices[0].message.content
    r = _synth(client, tenant, note, worker.id)
    ext = r.model_extra["contextkit"]
    assert ext["handles"] == [{"handle": worker.id, "read": "kv", "tokens": kept["tokens"], "read_tokens": 0}]
    assert ext["reused_tokens"] + ext["recomputed_tokens"] >= kept["tokens"]
    # the same request named by a handle in contextkit.handles instead of on the document
    r2 = _synth(client, tenant, note, None, handles=[worker.id])
    assert r2.model_extra["contextkit"]["handles"][0]["read"] == "kv"


def test_auto_finds_a_kept_answer_inside_a_message(served):
    """A framework that passes a worker's result on as message text and drops its id (LangGraph state, an
    Agents SDK tool result): ``handles: "auto"`` finds the tenant's recent kept answers by their tokens."""
    s, kit, client = served
    tenant = _fresh("graph")
    worker, kept = _worker(client, tenant)
    note = worker.choices[0].message.content
    msgs = [{"role": "system", "content": "You combine your workers' notes."},
            {"role": "user", "content": f"Worker 1 wrote:\n{note}\n\nWhat do the notes say about the Moon?"}]
    r = client.chat.completions.create(model="smol-local", max_tokens=8, temperature=0, messages=msgs,
                                       extra_body={"contextkit": {"tenant": tenant, "handles": "auto"}})
    ext = r.model_extra["contextkit"]
    assert ext["handles"] == [{"handle": worker.id, "read": "kv", "tokens": kept["tokens"], "read_tokens": 0}]
    other = client.chat.completions.create(model="smol-local", max_tokens=2, temperature=0, messages=msgs,
                                           extra_body={"contextkit": {"tenant": _fresh("other"), "handles": "auto"}})
    assert other.model_extra["contextkit"]["handles"] == []  # another tenant's answers are never looked at


def test_a_miss_is_the_text_path_whatever_the_reason(served):
    s, kit, client = served
    owner = _fresh("owner")
    worker, kept = _worker(client, owner)
    note = worker.choices[0].message.content
    # the reference: a request without a handle, cold in its tenant
    plain = _synth(client, _fresh("plain"), note)
    cases = {
        "unknown": (_fresh("thief"), note, worker.id),  # another tenant's handle: the same as an unknown one
        "malformed": (_fresh("typo"), note, {"id": 3}),
        "mismatch": (owner, note.upper(), worker.id),  # rewritten: under half of its tokens are in the prompt
    }
    for read, (tenant, text, handle) in cases.items():
        r = _synth(client, tenant, text, handle)
        ext = r.model_extra["contextkit"]
        assert ext["handles"][0]["read"] == read, read
        if text == note:  # the same prompt, prefilled as the plain request's: the handle changed nothing
            assert r.choices[0].model_extra["prompt_token_ids"] == plain.choices[0].model_extra["prompt_token_ids"]
            for k in ("reused_tokens", "recomputed_tokens", "prefilled_tokens", "cached_tokens"):
                assert ext[k] == plain.model_extra["contextkit"][k], (read, k)
    # an edit inside the answer: the runs on either side of it are still read from its KV (synthesis.splice)
    half = note.index(" ", len(note) // 2)
    edited = _synth(client, owner, note[:half] + " and cheese" + note[half:], worker.id)
    (got,) = edited.model_extra["contextkit"]["handles"]
    assert got["read"] == "kv" and kept["tokens"] // 2 <= got["tokens"] <= kept["tokens"], (got, note)
    # dropped by its owner: unknown from then on; another tenant cannot drop it
    url = f"{s.url}/v1/contextkit/kept/{worker.id}"
    assert httpx.delete(url, params={"tenant": _fresh("thief")}).json()["deleted"] is False
    assert httpx.delete(url, params={"tenant": owner}).json()["deleted"] is True
    assert _synth(client, owner, note, worker.id).model_extra["contextkit"]["handles"][0]["read"] == "unknown"
    metrics = httpx.get(s.url + "/metrics").text
    assert 'contextkit_serve_handle_reads_total{read="mismatch"}' in metrics


def test_more_handles_than_the_limit_is_422_naming_it(served):
    s, kit, client = served
    with pytest.raises(openai.UnprocessableEntityError, match="at most 4"):
        _synth(client, _fresh("many"), "a note", None, handles=[f"h{i}" for i in range(5)])
    with pytest.raises(openai.UnprocessableEntityError):  # keep is a boolean, not a truthy value
        _synth(client, _fresh("many"), "a note", None, keep="yes")


def test_the_kept_kv_is_the_answers_kv_in_its_workers_context(config):
    """``keep_answer`` against a full prefill of the worker's prompt and answer: the same keys and values
    of the answer and of the document the worker read, each re-positioned to 0 (fp32)."""
    from contextkit.core.generation import SamplingParams
    from contextkit.spans.compile import rotate_layers

    with ContextKit(config) as kit:
        req = kit.request(TASK, ["The Moon orbits the Earth every 27.3 days and has no atmosphere."])
        plan = kit.plan(req)  # no reuse asked: a plain prefill, the document computed in context
        stream = kit.run(plan, SamplingParams(max_new_tokens=12))
        gen = stream.finish()
        got = keep_answer(kit.spans, stream.generation, plan, plan.tenant)
        assert not isinstance(got, str), got
        span, text, read = got
        assert text == gen.text.strip() and len(read) == 1
        ids = plan.ids + list(gen.token_ids)
        cache = kit.engine.new_cache(len(ids))
        kit.engine.forward(cache, ids, logits="none")
        doc_at = next(sum(len(it.span.token_ids) for it in plan.items[:i])
                      for i, it in enumerate(plan.items) if it.span.kind == "document")
        answer_at = ids.index(span.token_ids[0], len(plan.ids))
        for kept, at in ((span, answer_at), (read[0], doc_at)):
            k = cache.k[:, :, at:at + kept.num_tokens].contiguous()
            rotate_layers(kit.spans.engine, k, -at, k, kit.spans.rerotator)
            torch.testing.assert_close(kept.k, k, atol=2e-4, rtol=1e-3)
            torch.testing.assert_close(kept.v, cache.v[:, :, at:at + kept.num_tokens], atol=2e-4, rtol=1e-3)
