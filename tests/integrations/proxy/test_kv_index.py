"""The index of what a vLLM server holds, fed the events vLLM publishes (here built by hand; the real
server's events are checked in ``test_kv_events.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextkit.integrations.proxy.kv_index import BlockIndex, FleetIndex, prompt_keys

BS = 4


def _store(index: BlockIndex, ids: list[int], salt: str | None, *, tag: str, parent=None, first_block: int = 0):
    """Store ``ids``' full blocks as vLLM reports them: hashes of its own, chained from ``parent``, the salt
    in the extra keys of the prompt's first block. Returns vLLM's hashes."""
    n = len(ids) // BS
    hashes = [f"{tag}-{first_block + i}".encode() for i in range(n)]
    extra = [(salt,) if first_block + i == 0 and salt else None for i in range(n)]
    index.stored(hashes, parent, ids[: n * BS], BS, extra)
    return hashes


def test_a_prompt_scores_the_blocks_its_tenant_cached_and_no_other_tenants():
    index = BlockIndex(block_size=BS)
    ids = list(range(100, 100 + 5 * BS + 2))
    _store(index, ids[: 3 * BS], "tenant-a", tag="a")
    assert index.held_prefix(prompt_keys(ids, block_size=BS, salt="tenant-a")) == 3
    # the same tokens under another salt, or none, are other blocks
    assert index.held_prefix(prompt_keys(ids, block_size=BS, salt="tenant-b")) == 0
    assert index.held_prefix(prompt_keys(ids, block_size=BS, salt=None)) == 0
    # a prompt that differs in its first block shares no later block either
    other = [7] + ids[1:]
    assert index.held_prefix(prompt_keys(other, block_size=BS, salt="tenant-a")) == 0


def test_blocks_chain_from_their_parent_across_events_and_removal_cuts_the_prefix():
    index = BlockIndex(block_size=BS)
    ids = list(range(6 * BS))
    first = _store(index, ids[: 2 * BS], "t", tag="x")
    later = _store(index, ids[2 * BS : 5 * BS], "t", tag="x", parent=first[-1], first_block=2)
    keys = prompt_keys(ids, block_size=BS, salt="t")
    assert index.held_prefix(keys) == 5
    index.removed([later[0]])  # block 2 evicted: vLLM reuses blocks 0-1 only
    assert index.held_prefix(keys) == 2
    index.removed([b"never-seen"])
    index.cleared()
    assert index.held_prefix(keys) == 0 and len(index) == 0


def test_a_block_whose_parent_is_unknown_is_skipped_and_counted():
    index = BlockIndex(block_size=BS)
    assert index.stored([b"h1"], b"not-indexed", list(range(BS)), BS, None) == 0
    assert index.counts["unknown_parent"] == 1 and len(index) == 0


@pytest.mark.parametrize("event", [
    dict(hashes=[b"h"], parent=None, token_ids=list(range(BS + 1)), block_size=BS),  # tokens do not fill it
    dict(hashes=[b"h"], parent=None, token_ids=list(range(8)), block_size=8),  # another block size
    dict(hashes=[b"h", b"i"], parent=None, token_ids=list(range(2 * BS)), block_size=BS, extra_keys=[None]),
    dict(hashes=[b"h"], parent=None, token_ids=[2**70] * BS, block_size=BS),  # no int64 token id
])
def test_a_malformed_event_is_refused_whole(event):
    index = BlockIndex(block_size=BS)
    assert index.stored(event["hashes"], event["parent"], event["token_ids"], event["block_size"],
                        event.get("extra_keys")) == 0
    assert index.counts["refused"] == 1 and len(index) == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 50), min_size=BS, max_size=3 * BS),
                          st.sampled_from(["a", "b", None])), max_size=40))
def test_memory_stays_bounded_and_what_is_held_is_what_was_stored_last(events):
    """Whatever is stored, re-stored and removed, the index never holds more than its bound, and a prompt's
    score never exceeds what was stored under its salt."""
    index = BlockIndex(block_size=BS, max_blocks=6)
    for i, (op, ids, salt) in enumerate(events):
        if op == 3:
            index.removed([f"p{i - 1}-0".encode()])
        else:
            _store(index, ids, salt, tag=f"p{i}")
        assert len(index) <= 6 and sum(index._held.values()) == len(index)
        keys = prompt_keys(ids, block_size=BS, salt=salt)
        assert index.held_prefix(keys) <= min(len(keys), 6)


def test_the_oldest_block_is_forgotten_first():
    index = BlockIndex(block_size=BS, max_blocks=3)
    a, b = list(range(BS)), list(range(50, 50 + BS))
    _store(index, a, "t", tag="a")
    _store(index, list(range(10, 10 + 3 * BS)), "t", tag="c")  # three more: a is forgotten
    assert index.held_prefix(prompt_keys(a, block_size=BS, salt="t")) == 0
    _store(index, b, "t", tag="b")
    assert index.held_prefix(prompt_keys(b, block_size=BS, salt="t")) == 1
    assert index.counts["forgotten"] == 2 and len(index) == 3


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4),
                          st.lists(st.integers(0, 1), min_size=BS, max_size=4 * BS),
                          st.sampled_from(["a", "b"])), min_size=1, max_size=30),
       st.data())
def test_the_fleet_index_scores_every_server_as_its_own_index_does(events, data):
    """Three servers' events (stores, removals, clears, forgetting past a small bound): one pass over the
    fleet's map gives each server the score its own index gives. The prompt continues one of the stored
    prompts, so that servers hold different lengths of it."""
    fleet = FleetIndex()
    servers = [BlockIndex(block_size=BS, max_blocks=5, fleet=fleet, server=s) for s in range(3)]
    for i, (server, op, ids, sal) in enumerate(events):
        index = servers[server]
        if op == 3:
            index.removed([f"e{i - 1}-0".encode(), f"e{i - 2}-1".encode()])
        elif op == 4:
            index.cleared()
        else:
            _store(index, ids, sal, tag=f"e{i}")
    _, _, base, salt = data.draw(st.sampled_from(events))
    prompt = base[: data.draw(st.integers(0, len(base)))] + data.draw(st.lists(st.integers(0, 1), max_size=2 * BS))
    keys = prompt_keys(prompt, block_size=BS, salt=salt)
    want = {s: idx.held_prefix(keys) for s, idx in enumerate(servers) if idx.held_prefix(keys)}
    assert fleet.held_prefixes(keys) == want
    groups = fleet.depth_groups(keys)  # what routing reads: deepest first, each server in one group
    assert [d for d, _ in groups] == sorted({*want.values()}, reverse=True)
    assert all(want[s] == d for d, m in groups for s in range(3) if m >> s & 1)
    assert len(fleet) == len(set().union(*(idx._held for idx in servers)))


def test_an_expected_block_is_held_until_its_time_and_a_stored_one_outlives_its_expectation():
    fleet = FleetIndex()
    index = BlockIndex(block_size=BS, fleet=fleet, server=3)
    ids = list(range(3 * BS))
    keys = prompt_keys(ids, block_size=BS, salt="t")
    index.expect(keys, until=10.0)
    assert index.held_prefix(keys) == 3 and fleet.held_prefixes(keys) == {3: 3}
    _store(index, ids[:BS], "t", tag="s")  # the server confirms the first block
    index.expire(9.9)
    assert index.held_prefix(keys) == 3
    index.expire(10.0)
    assert index.held_prefix(keys) == 1 and fleet.held_prefixes(keys) == {3: 1}
    index.expect(keys[:1], until=20.0)
    index.removed([b"s-0"])  # evicted while expected: still claimed until the expectation ends
    assert index.held_prefix(keys) == 1
    index.expire(20.0)
    assert index.held_prefix(keys) == 0 and len(fleet) == 0
