"""Placing requests over several upstreams: by the blocks each one's events say it holds, under a load
limit, by the proxy's model when an upstream publishes nothing, by rendezvous affinity when nothing is
held anywhere. Events are built by hand here; ``test_fleet.py`` runs two real vLLM servers."""

from __future__ import annotations

import pytest

from contextkit.core.tenant import Tenant
from contextkit.core.types import Doc
from contextkit.integrations.proxy.kv_index import prompt_keys
from contextkit.integrations.proxy.routing import Router, prompt_ids, rendezvous, session_key
from contextkit.integrations.proxy.settings import ProxySettings
from contextkit.integrations.proxy.upstreams import UpstreamPool

BS = 4


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _router(n=2, events=True, slack=4, clock=None):
    urls = [f"http://up{i}:8000" for i in range(n)]
    settings = ProxySettings(upstreams=urls, block_size=BS, route_slack=slack, events_stale_s=10.0,
                             upstream_events=[f"ipc:///tmp/never-{i}" if events else "none" for i in range(n)])
    pool = UpstreamPool(urls, BS)
    router = Router(pool.upstreams, settings, clock=clock or Clock())
    for v in router.views:
        if v is not None:
            v.running = True  # the subscriber's socket is up (tests feed the index by hand)
    return pool, router


def _cache(router: Router, i: int, ids: list[int], salt: str) -> None:
    """Upstream ``i`` reports it cached ``ids``' full blocks under ``salt`` (as vLLM's BlockStored does)."""
    n = len(ids) // BS
    hashes = [f"{i}-{salt}-{ids[:(b + 1) * BS]}".encode() for b in range(n)]
    router.views[i].index.stored(hashes, None, ids[: n * BS], BS, [(salt,)] + [None] * (n - 1))
    router.views[i].feed.last_event_at = router.clock()


def test_a_request_goes_where_its_prefix_is_and_never_scores_another_tenants_blocks():
    pool, router = _router()
    a, b = pool.upstreams
    ids = list(range(50, 50 + 6 * BS))
    _cache(router, 1, ids[: 4 * BS], "tenant-a")
    keys = prompt_keys(ids, block_size=BS, salt="tenant-a")
    choice = router.pick(pool.healthy(), events=router.held(keys))
    assert choice.upstream is b and choice.rule == "events" and choice.held_blocks == 4
    # the same prompt under another tenant's salt holds nothing anywhere: least loaded, not b
    other = router.pick(pool.healthy(), events=router.held(prompt_keys(ids, block_size=BS, salt="tenant-b")))
    assert other.upstream is a and other.rule == "least_loaded"


def test_load_past_the_slack_sends_a_hot_prefix_elsewhere_and_is_counted():
    pool, router = _router(slack=2)
    a, b = pool.upstreams
    ids = list(range(4 * BS))
    _cache(router, 0, ids, "t")
    keys = prompt_keys(ids, block_size=BS, salt="t")
    a.inflight = 2  # within the slack of b's 0: the cache still wins
    assert router.pick(pool.healthy(), events=router.held(keys)).upstream is a
    a.inflight = 3
    choice = router.pick(pool.healthy(), events=router.held(keys))
    assert choice.upstream is b and choice.rule == "least_loaded"
    assert router.decisions["overloaded"] == 1


def test_an_upstream_silent_after_new_blocks_goes_stale_and_comes_back_with_its_events():
    clock = Clock()
    pool, router = _router(clock=clock)
    a, _ = pool.upstreams
    ids = list(range(3 * BS))
    _cache(router, 0, ids, "t")
    keys = prompt_keys(ids + list(range(900, 900 + 2 * BS)), block_size=BS, salt="t")
    router.accepted(router.sent(a, keys), 200)  # a holds 3 of its 5 blocks and took them: an event is due
    clock.now += 9.9
    assert router.fresh(0)
    clock.now += 0.2
    assert not router.fresh(0)  # stale: scored by the fallback (the model), not by its events
    assert router.pick(pool.healthy(), events=router.held(keys)).rule != "events"
    router.views[0].feed.last_event_at = clock.now  # its events flow again
    assert router.fresh(0) and router.held(keys) == {0: 3}
    router.accepted(router.sent(a, keys[:3]), 200)  # all held: no event is due, the clock does not start
    clock.now += 60
    assert router.fresh(0)


def test_only_a_request_the_upstream_accepted_starts_the_stale_clock():
    """vLLM caches and publishes nothing for a request it refuses (a 4xx: too long, a bad parameter), so
    a refusal must not make a quiet upstream stale; an accepted one's clock runs from when it was sent."""
    clock = Clock()
    pool, router = _router(clock=clock)
    a, _ = pool.upstreams
    keys = prompt_keys(list(range(5 * BS)), block_size=BS, salt="t")
    router.accepted(router.sent(a, keys), 400)
    clock.now += 60
    assert router.fresh(0) and router.held(keys) == {}  # no clock; its expectations have expired
    sent = router.sent(a, keys)
    clock.now += 8  # a non-streamed answer starts when it is done
    router.accepted(sent, 200)
    clock.now += 2.1
    assert not router.fresh(0)  # 10.1 s since it was sent, no event
    router.views[0].feed.last_event_at = clock.now
    assert router.fresh(0)
    sent = router.sent(a, prompt_keys(list(range(900, 900 + 3 * BS)), block_size=BS, salt="t"))
    clock.now += 1
    router.views[0].feed.last_event_at = clock.now  # its events came before its answer
    clock.now += 1
    router.accepted(sent, 200)
    clock.now += 60
    assert router.fresh(0)


def test_without_events_documents_follow_the_model_and_conversations_their_affinity():
    pool, router = _router(events=False)
    a, b = pool.upstreams
    docs = [Doc(id=i, tokens=64) for i in "xyz"]
    b.weaver.record(docs, Tenant())
    estimate = b.weaver.order(docs, Tenant(), record=False).reusable_tokens // BS
    choice = router.pick(pool.healthy(), events={}, model={0: 0, 1: estimate})
    assert choice.upstream is b and choice.rule == "model"
    session = session_key({"messages": [{"role": "user", "content": "hi"}]}, "salt")
    picked = {router.pick(pool.healthy(), events={}, session=session).upstream.url for _ in range(3)}
    assert len(picked) == 1 and router.decisions["affinity"] == 3


def test_rendezvous_is_the_same_on_every_replica_and_a_new_upstream_takes_few_sessions():
    pool = UpstreamPool([f"http://up{i}:8000" for i in range(4)], BS)
    more = UpstreamPool([f"http://up{i}:8000" for i in range(5)], BS)
    keys = [session_key({"prompt_cache_key": f"conv-{k}"}, "s") for k in range(400)]
    before = [rendezvous(k, pool.upstreams).url for k in keys]
    assert before == [rendezvous(k, list(reversed(pool.upstreams))).url for k in keys]  # order-free
    after = [rendezvous(k, more.upstreams).url for k in keys]
    moved = [(x, y) for x, y in zip(before, after) if x != y]
    assert all(y == "http://up4:8000" for _, y in moved)  # only to the new one
    assert 40 < len(moved) < 140  # about a fifth
    assert len(set(before)) == 4


def test_session_keys_are_per_tenant_and_prefer_prompt_cache_key():
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "a"}]}
    later = {"messages": chat["messages"] + [{"role": "user", "content": "q2"}]}
    assert session_key(chat, "t1") == session_key(later, "t1")  # one conversation, turn after turn
    assert session_key(chat, "t1") != session_key(chat, "t2")
    assert session_key({**chat, "prompt_cache_key": "k"}, "t1") == session_key({"prompt_cache_key": "k"}, "t1")
    assert session_key({"prompt": "x"}, "t1") is None


def test_prompts_are_rendered_only_when_vllm_would_render_them_the_same(smol_dir):
    from contextkit.core.tokenizer import Tokenizer

    tok = Tokenizer(smol_dir)
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
    ids = prompt_ids("/v1/chat/completions", chat, tok)
    assert ids == tok.encode(tok.render_chat(chat["messages"]))
    for odd in ({**chat, "tools": []}, {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
                {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, {"messages": []}):
        assert prompt_ids("/v1/chat/completions", odd, tok) is None
    assert prompt_ids("/v1/completions", {"prompt": [5, 6, 7]}, tok) == [5, 6, 7]
    assert prompt_ids("/v1/completions", {"prompt": ["first one", "second"]}, tok) == tok.encode("first one", True)
    assert prompt_ids("/v1/responses", {"input": "x"}, tok) is None


def test_events_entries_must_match_the_upstreams():
    with pytest.raises(ValueError, match="one per --upstream"):
        ProxySettings(upstreams=["http://a:1", "http://b:1"], upstream_events=["tcp://a:5557"])
    with pytest.raises(ValueError, match="tcp:// or ipc://"):
        ProxySettings(upstreams=["http://a:1"], upstream_events=["http://a:5557"])
    with pytest.raises(ValueError, match="at most one replay"):
        ProxySettings(upstreams=["http://a:1"], upstream_events=["tcp://a:1,tcp://a:2,tcp://a:3"])
    ok = ProxySettings(upstreams=["http://a:1", "http://b:1"], upstream_events=["tcp://a:5557,tcp://a:5558", "none"])
    router = Router(UpstreamPool(ok.upstreams, 32).upstreams, ok)
    assert router.views[1] is None and router.views[0].subscriber.replay_endpoint == "tcp://a:5558"


def test_a_prompt_just_sent_counts_as_held_until_its_events_arrive_or_its_time_runs_out():
    clock = Clock()
    pool, router = _router(clock=clock)
    a, b = pool.upstreams
    ids = list(range(300, 300 + 4 * BS))
    keys = prompt_keys(ids, block_size=BS, salt="t")
    router.sent(b, keys)  # on its way to b; b has published nothing yet
    follow_up = prompt_keys(ids + list(range(7, 7 + 2 * BS)), block_size=BS, salt="t")
    choice = router.pick(pool.healthy(), events=router.held(follow_up))
    assert choice.upstream is b and choice.held_blocks == 4  # the next turn follows it at once
    clock.now += 0.5
    _cache(router, 1, ids[: 2 * BS], "t")  # b's events confirm the first two blocks only
    clock.now += 9.6
    assert router.held(follow_up) == {1: 2}  # the unconfirmed rest expired
    router.views[1].index.cleared()
    assert router.held(follow_up) == {}


def test_a_few_shared_blocks_do_not_outweigh_a_queued_request_but_a_long_prefix_does():
    pool, router = _router()
    a, b = pool.upstreams
    ids = list(range(1000, 1000 + 20 * BS))
    keys = prompt_keys(ids, block_size=BS, salt="t")
    _cache(router, 0, ids[: 2 * BS], "t")  # a holds only the first two blocks (a system prompt, say)
    a.inflight = 1
    choice = router.pick(pool.healthy(), events=router.held(keys), blocks=len(keys))
    assert choice.upstream is b and choice.rule == "least_loaded" and router.decisions["overloaded"] == 1
    router.views[0].index.cleared()
    _cache(router, 0, ids[: 18 * BS], "t")  # now a holds 18 of the 20: worth more than one request ahead
    choice = router.pick(pool.healthy(), events=router.held(keys), blocks=len(keys))
    assert choice.upstream is a and choice.rule == "events" and choice.held_blocks == 18
    a.inflight = 0  # equal load: even two shared blocks decide
    router.views[0].index.cleared()
    _cache(router, 0, ids[: 2 * BS], "t")
    assert router.pick(pool.healthy(), events=router.held(keys), blocks=len(keys)).upstream is a


def test_the_fleets_events_recover_the_order_another_replica_sent(smol_dir, passage_text):
    """A session's next request reaches a proxy replica whose Weaver never saw the order its first request
    was sent in: the order the servers hold is found from their events."""
    from contextkit.core.planner import ChatRequest, FixedOrder, Planner
    from contextkit.core.tokenizer import Tokenizer
    from contextkit.core.types import Evidence, Message
    from contextkit.integrations.proxy.kv_index import BlockIndex, FleetIndex, keys_by
    from contextkit.ordering.event_order import event_order

    planner = Planner(Tokenizer(smol_dir), block_size=32)
    docs = tuple(Evidence(passage_text[i * 600 : (i + 1) * 600], id=f"d{i}") for i in range(5))
    sent = (3, 0, 4, 1, 2)  # what the other replica's Weaver chose for the first request
    first = ChatRequest((Message("user", "Who is named first?"),), docs, ordering="weaver")
    ids = planner.plan(first, FixedOrder(sent)).ids
    fleet = FleetIndex()
    index = BlockIndex(block_size=32, fleet=fleet, server=1)
    keys = prompt_keys(ids, block_size=32, salt="s")
    index.expect(keys, until=1e9)  # the server holds that prompt (as its events would say)

    def depth(k):
        return max(fleet.held_prefixes(k).values(), default=0)

    later = ChatRequest((Message("user", "And who is named last?"),), docs[::-1], ordering="weaver")
    plan, search = event_order(planner, later, depth=depth, block_size=32, keys_of=keys_by(salt="s", block_size=32))
    assert [plan.document_ids[i] for i in range(5)] == [f"d{i}" for i in sent]
    assert plan.expected_cached_tokens >= len(keys) * 32 - 2 * 32  # all but the question's blocks
    assert search.outcome == "found" and search.scores <= 5 + 4 + 3 + 2
    other = keys_by(salt="other-tenant", block_size=32)
    assert event_order(planner, later, depth=depth, block_size=32, keys_of=other)[0] is None
    kept = ChatRequest(later.messages, later.documents, ordering="retrieval")
    same = keys_by(salt="s", block_size=32)
    assert event_order(planner, kept, depth=depth, block_size=32, keys_of=same)[0] is None  # the client's order stands
