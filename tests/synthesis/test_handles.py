"""Kept worker answers (``synthesis.handles``): the store's tenancy, limits and TTL, and how a synthesizer's
plan reads a named handle from KV where its tokens are, and from the text everywhere else."""

from __future__ import annotations

import pytest
import torch

from contextkit.core.errors import InputError
from contextkit.core.plan import PlanItem, RequestPlan
from contextkit.core.policy import ReuseOptions
from contextkit.core.tenant import Tenant
from contextkit.core.types import Span
from contextkit.kernels.rope import RopeSpec
from contextkit.spans.key import ModelIdentity, span_key
from contextkit.spans.store import CompiledSpan
from contextkit.synthesis.handles import KeepLimits, KeptSpans
from contextkit.synthesis.splice import splice

IDENTITY = ModelIdentity("a" * 64, "tok", "float32", (RopeSpec(8, 10000.0),))


def _span(ids: tuple[int, ...], tenant: str = "") -> CompiledSpan:
    k = torch.zeros(1, 1, len(ids), 8)  # 64 bytes a token (k and v)
    return CompiledSpan(span_key(IDENTITY, ids, (), tenant), ids, k, k.clone())


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_tenant_finds_only_its_own_handles_and_they_expire():
    clock = Clock()
    store = KeptSpans(KeepLimits(ttl_s=10), clock)
    acme, globex = Tenant("acme"), Tenant("globex")
    assert store.put(acme, "chatcmpl-1", _span((1, 2, 3), "acme"), "a b c")
    assert store.get(acme, "chatcmpl-1")[1] == "kv"
    assert store.get(globex, "chatcmpl-1") == (None, "unknown")  # the same answer as a handle never kept
    assert store.get(acme, {"not": "a handle"}) == (None, "malformed")
    assert store.get(acme, "x" * 200) == (None, "malformed")
    clock.now = 10.0
    assert store.get(acme, "chatcmpl-1") == (None, "expired")
    assert store.stats() == {"handles": 0, "bytes": 0, "evicted": 0}


def test_limits_hold_per_key_tenant_and_in_all():
    store = KeptSpans(KeepLimits(max_handles=2, max_bytes=64 * 10, max_total_bytes=64 * 14), Clock())
    # sub-tenants of one key share its limits: the third answer evicts the key's oldest
    for i, who in enumerate(["acme:a", "acme:b", "acme:c"]):
        assert store.put(Tenant(who), f"h{i}", _span((i, i + 1)), "x")
    assert store.get(Tenant("acme:a"), "h0")[1] == "unknown" and store.get(Tenant("acme:c"), "h2")[1] == "kv"
    # bytes per key: 10 tokens' worth; an 8-token answer evicts the key's other answers as needed
    assert store.put(Tenant("acme"), "big", _span(tuple(range(8))), "x")
    assert store.stats()["bytes"] <= 64 * 10
    # another key is held to the same limits, and all keys together to the total
    assert store.put(Tenant("globex"), "g", _span(tuple(range(9))), "x")
    assert store.stats()["bytes"] <= 64 * 14
    assert store.get(Tenant("globex"), "g")[1] == "kv"
    assert not store.put(Tenant("globex"), "huge", _span(tuple(range(11))), "x")  # alone over max_bytes
    assert store.stats()["evicted"] >= 2
    with pytest.raises(InputError, match="handle"):
        store.put(Tenant("acme"), "no spaces", _span((1,)), "x")


def _plan(*items: tuple[tuple[int, ...], bool], options: ReuseOptions | None = ReuseOptions()) -> RequestPlan:
    spans = (PlanItem(Span(ids, "document" if reuse else "query"), reuse=reuse) for ids, reuse in items)
    return RequestPlan(tuple(spans), options)


def test_a_named_handle_is_read_from_kv_where_its_tokens_are_and_the_text_is_used_elsewhere():
    store, acme = KeptSpans(), Tenant("acme")
    store.put(acme, "w1", _span((5, 6, 7), "acme"), "five six seven")
    store.put(acme, "w2", _span((8, 9), "acme"), "eight nine")
    store.put(acme, "w3", _span((30, 31), "acme"), "edited away")
    plan = _plan(((1, 2), True), ((3, 5, 6, 7, 4), True), ((10, 8, 9, 11), False))
    new, provided, reads = splice(plan, ["w1", "w2", "w3", "w1", "gone", 7], store, acme)
    assert [r.read for r in reads] == ["kv", "kv", "mismatch", "repeated", "unknown", "malformed"]
    assert [r.tokens for r in reads[:2]] == [3, 2]
    assert new.ids == plan.ids  # the same prompt, token for token: only how its KV is obtained changes
    got = {new.items[i].span.token_ids: span.token_ids for i, span in provided.items()}
    assert got == {(5, 6, 7): (5, 6, 7), (8, 9): (8, 9)}
    assert all(new.items[i].reuse for i in provided)
    assert not new.items[-1].reuse  # the query still ends the plan
    # the answer may not end the prompt (the last item starts the answer): its end is left to the text
    tail = splice(_plan(((1,), True), ((4, 5, 6, 7), False)), ["w1"], store, acme)
    assert [(r.read, r.tokens) for r in tail[2]] == [("kv", 2)] and tail[0].items[-1].span.token_ids == (7,)
    # so are up to two last tokens the prompt tokenizes otherwise (Qwen joins "." with "\n\n")
    merged = splice(_plan(((3, 5, 6, 99, 4), True), ((10,), False)), ["w1"], store, acme)
    assert [(r.read, r.tokens) for r in merged[2]] == [("kv", 2)]
    assert [s.token_ids for s in merged[1].values()] == [(5, 6)] and merged[0].ids == [3, 5, 6, 99, 4, 10]
    (span,) = merged[1].values()
    assert span.problem(span.key) is None and span.k.shape[2] == 2
    # a request that prefills in full reads nothing from KV
    full = splice(_plan(((5, 6, 7), True), ((4,), False), options=ReuseOptions(policy="full")), ["w1"], store, acme)
    assert [r.read for r in full[2]] == ["not_reused"] and not full[1]
    # another tenant naming the same handles finds nothing
    other = splice(plan, ["w1"], store, Tenant("globex"))
    assert [r.read for r in other[2]] == ["unknown"] and other[0].ids == plan.ids and not other[1]


def test_more_handles_than_the_limit_is_refused_with_the_limit():
    store = KeptSpans(KeepLimits(max_per_request=2))
    with pytest.raises(InputError, match="at most 2"):
        splice(_plan(((1,), False)), ["a", "b", "c"], store, Tenant())


def test_auto_finds_the_tenants_recent_answers_by_their_text():
    store, acme = KeptSpans(KeepLimits(max_per_request=2)), Tenant("acme")
    store.put(acme, "old", _span((20, 21), "acme"), "oldest")  # past the two most recent: not looked for
    store.put(acme, "w1", _span((5, 6, 7), "acme"), "five six seven")
    store.put(acme, "w2", _span((8, 9), "acme"), "not in this prompt")
    store.put(Tenant("globex"), "g", _span((1, 2), "globex"), "another tenant's")
    plan = _plan(((1, 2), True), ((3, 5, 6, 7, 20, 21), True), ((10, 11), False))
    new, provided, reads = splice(plan, "auto", store, acme)
    assert [(r.handle, r.read) for r in reads] == [("w1", "kv")]  # only what was found is reported
    assert [s.token_ids for s in provided.values()] == [(5, 6, 7)] and new.ids == plan.ids
    with pytest.raises(InputError, match="auto"):
        splice(plan, "all", store, acme)


def test_the_documents_a_worker_read_are_read_from_its_kv_where_the_prompt_has_them_whole():
    store, acme = KeptSpans(), Tenant("acme")
    passage, other = _span((40, 41, 42), "acme"), _span((50, 51), "acme")
    store.put(acme, "w1", _span((5, 6, 7), "acme"), "note", read=[passage, other])
    assert store.stats()["bytes"] == 64 * 8  # the answer and what its worker read
    plan = _plan(((1,), True), ((40, 41, 42), True), ((50, 51, 52), True), ((3, 5, 6, 7, 4), True), ((9,), False))
    new, provided, reads = splice(plan, ["w1"], store, acme)
    assert [(r.read, r.tokens, r.read_tokens) for r in reads] == [("kv", 3, 3)]  # (50, 51) is no whole document
    assert provided[1] is passage and new.ids == plan.ids
    # a worker's documents alone (its answer not in the prompt) are not read: the handle is a mismatch
    none = splice(_plan(((40, 41, 42), True), ((9,), False)), ["w1"], store, acme)
    assert [r.read for r in none[2]] == ["mismatch"] and not none[1]
