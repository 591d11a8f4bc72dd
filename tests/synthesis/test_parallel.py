"""Parallel branches over one shared prefix and the synthesizer that reads their KV, on the real model:
the prefix is one copy, each branch computes what a plain prefill of its own prompt would, a failing
branch leaves the others whole, and join at r=1 equals the text-concatenation synthesizer."""

from __future__ import annotations

import pytest
import torch

from contextkit.core.errors import ConfigError, EmptyInputError
from contextkit.core.generation import SamplingParams
from contextkit.core.policy import ReuseOptions
from contextkit.core.tokenizer import Tokenizer
from contextkit.engine.model import Engine
from contextkit.spans.assemble import SpanCache
from contextkit.synthesis.parallel import fork, join, join_text

pytestmark = pytest.mark.slow
TOL = 1e-3


@pytest.fixture(scope="module")
def kit(smol_dir):
    engine, tok = Engine.from_dir(smol_dir), Tokenizer(smol_dir)
    return SpanCache(engine, tokenizer_fingerprint=tok.fingerprint), tok


def _prompts(tok):
    prefix = tok.encode("You are one of three workers. Each reads one passage and writes a short note.\n\n")
    passages = ["Passage: The Eiffel Tower was completed in 1889 for the World's Fair in Paris.\nNote:",
                "Passage: Gustave Eiffel's company designed and built the tower.\nNote:",
                "Passage: The tower is 330 metres tall and was the tallest structure until 1930.\nNote:"]
    return prefix, [tok.encode(p) for p in passages]


def test_branches_share_one_prefix_and_compute_what_a_plain_prefill_would(kit):
    spans, tok = kit
    prefix, prompts = _prompts(tok)
    f = fork(spans, tok, prefix, prompts, SamplingParams(max_new_tokens=12))
    assert all(b.ok and len(b.token_ids) >= 1 for b in f.branches)
    segs = f.cache.segments[: f.cache.length]
    assert int((segs == 0).sum()) == len(prefix)  # the prefix's KV is written once, in one cache
    engine = spans.engine
    for b in f.branches:
        ids = list(prefix) + list(b.prompt_ids) + b.token_ids
        ref = engine.new_cache(len(ids))
        engine.forward(ref, ids, logits="none")
        mine = torch.tensor(b.slots)  # prompt and generated tokens of this branch, in order
        n = len(prefix)
        assert torch.allclose(f.cache.k[:, :, mine], ref.k[:, :, n:len(ids)], atol=TOL)
        assert torch.allclose(f.cache.v[:, :, mine], ref.v[:, :, n:len(ids)], atol=TOL)
        assert f.cache.positions[mine].tolist() == list(range(n, len(ids)))
        span = f.span(b)
        assert span.num_tokens == len(b.token_ids)  # only the branch's own tokens: no prefix copy


def test_a_failing_branch_leaves_the_others_whole(kit):
    spans, tok = kit
    prefix, prompts = _prompts(tok)

    def hook(branch: int, token: int) -> None:
        if branch == 1 and hook.seen.setdefault(branch, 0) >= 2:
            raise RuntimeError("tool call failed")
        hook.seen[branch] = hook.seen.get(branch, 0) + 1

    hook.seen = {}
    f = fork(spans, tok, prefix, prompts, SamplingParams(max_new_tokens=8, stop_token_ids=()), hook=hook)
    bad = f.branches[1]
    assert bad.error == "RuntimeError: tool call failed" and len(bad.token_ids) == 2
    assert all(b.ok and len(b.token_ids) == 8 for b in (f.branches[0], f.branches[2]))
    with pytest.raises(ConfigError, match="branch 1 failed"):
        f.span(bad)
    asm, used, _ = join(f, tok.encode("Combine the notes.\n"), tok.encode("\nAnswer:"))
    assert [b.index for b in used] == [0, 2] and asm.report.hits >= 2


def test_join_at_r1_equals_the_text_synthesizer(kit):
    spans, tok = kit
    prefix, prompts = _prompts(tok)
    f = fork(spans, tok, prefix, prompts, SamplingParams(max_new_tokens=16))
    head = tok.encode("You combine workers' notes into one answer.\nQuestion: Who built the tower, and when?\n")
    tail = tok.encode("\nAnswer:")
    labels = [tok.encode(f"\nNote {i + 1}:") for i in range(len(prompts))]
    text, _, _ = join_text(f, head, tail, labels)
    exact, _, _ = join(f, head, tail, labels, ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=None))
    assert (exact.logits - text.logits).abs().max().item() <= TOL
    fast, _, plan = join(f, head, tail, labels)  # the default policy: most branch KV reused
    r = fast.report
    notes = sum(len(b.token_ids) for b in f.branches)
    assert r.reused_tokens + r.recomputed_tokens == notes + len(head) and r.reused_tokens > notes // 2
    assert torch.isfinite(fast.logits).all()


def test_join_reads_whole_transcripts_when_asked(kit):
    spans, tok = kit
    prefix, prompts = _prompts(tok)
    f = fork(spans, tok, prefix, prompts, SamplingParams(max_new_tokens=8))
    head = tok.encode("You combine workers' transcripts into one answer.\nQuestion: How tall is the tower?\n")
    tail, labels = tok.encode("\nAnswer:"), [tok.encode(f"\nWorker {i + 1}:") for i in range(len(prompts))]
    b = f.branches[2]
    span = f.span(b, transcript=True)  # what the worker read and wrote: its own slots, keys at position 0
    assert span.token_ids == b.prompt_ids + tuple(b.token_ids) and span.key != f.span(b).key
    mine = torch.tensor(b.slots)
    assert torch.equal(span.v, f.cache.v[:, :, mine])
    text, _, plan = join_text(f, head, tail, labels, transcripts=True)
    assert sum(len(it.span.token_ids) for it in plan.items) == len(head) + len(tail) + sum(
        len(x) for x in labels) + sum(len(x.prompt_ids) + len(x.token_ids) for x in f.branches)
    exact, _, _ = join(f, head, tail, labels, ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=None),
                       transcripts=True)
    assert (exact.logits - text.logits).abs().max().item() <= TOL
    fast, _, _ = join(f, head, tail, labels, transcripts=True)
    assert fast.report.reused_tokens > sum(len(x.prompt_ids) for x in f.branches) // 2


def test_bad_input(kit):
    spans, tok = kit
    prefix, prompts = _prompts(tok)
    with pytest.raises(EmptyInputError):
        fork(spans, tok, [], prompts)
    with pytest.raises(EmptyInputError):
        fork(spans, tok, prefix, [prompts[0], []])
    f = fork(spans, tok, prefix, prompts[:1], SamplingParams(max_new_tokens=4))
    from contextkit.synthesis.parallel import synthesis_plan

    plan, where = synthesis_plan(tok.encode("Head.\n"), [f.branches[0].token_ids], tok.encode("Answer:"))
    wrong = f.span(f.branches[0])
    with pytest.raises(ConfigError, match="not a reused item"):
        spans.assemble(plan, provided={len(plan.items) - 1: wrong})
