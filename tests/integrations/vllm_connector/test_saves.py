"""The connector's saves without a server: the save queue between vLLM's step and the store (staging,
the byte budget, eviction by worth, failures) and the pacer that decides when the save thread writes.

The queue runs on real pieces: ``PagedKV`` over caches packed by vLLM's own CPU op, a ``TieredStore`` of
memory tiers whose ``put`` the test holds or fails on purpose, and the real thread. Nothing sleeps: the
test waits for events the store raises, and the pacer's decision is a function of a given clock.
"""

from __future__ import annotations

import threading

import pytest
import torch

from contextkit.integrations.vllm_connector.keys import ConnectorKey
from contextkit.integrations.vllm_connector.pacing import Pacer
from contextkit.integrations.vllm_connector.paged import PagedKV, slots_of
from contextkit.integrations.vllm_connector.saves import SaveOp, SaveQueue
from contextkit.integrations.vllm_connector.stats import Counters
from contextkit.kvstore.memory import MemoryTier
from contextkit.kvstore.tiered import TieredStore

BS, LAYERS, BLOCKS = 32, 4, 6


class HeldTier(MemoryTier):
    """A real memory tier whose ``put`` waits until the test lets it go (or fails, if told to)."""

    name = "held"

    def __init__(self, fail_first: int = 0):
        super().__init__(1 << 30)
        self.release, self.entered, self.held = threading.Event(), threading.Event(), []
        self.fail_first, self.calls = fail_first, 0

    def put(self, key, entry):
        self.calls += 1
        self.held.append(sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                              for t in entry.tensors.values()}.values()))
        self.entered.set()
        assert self.release.wait(60)
        if self.calls <= self.fail_first:
            raise OSError("the store refused the write (on purpose)")
        super().put(key, entry)


@pytest.fixture
def step():
    """Six blocks of four layers, packed by vLLM's CPU op, and a request's saves of them (one per block)."""
    caches = [(f"layers.{i}.attn", torch.zeros(BLOCKS, 3, BS, 128, dtype=torch.bfloat16)) for i in range(LAYERS)]
    paged = PagedKV(caches[0][1], BS, isa="vec")
    table = (4, 1, 5, 0, 2, 3)  # the request's block table, out of order
    slots = slots_of(list(table), BS, 0, BLOCKS * BS)
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(3, BLOCKS * BS, 64, generator=g).to(torch.bfloat16),
           torch.randn(3, BLOCKS * BS, 64, generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]
    for (_, cache), (k, v) in zip(caches, kv):
        paged.write(cache, slots, k, v)
    ops = [SaveOp(ConnectorKey(f"{b:064x}", "salt.t", BS), b * BS, (b + 1) * BS, tuple(range(BS)), table)
           for b in range(BLOCKS)]
    entry_bytes = BS * (2 * LAYERS * 3 * 64 * 2 + 8)  # k and v in bf16, and the token ids
    return type("Step", (), dict(caches=caches, paged=paged, ops=ops, kv=kv, entry_bytes=entry_bytes))


def test_a_stuck_store_holds_no_step_and_the_budget_holds(step):
    """While the store's put is stuck the step still returns (a save that waited for the store would hang
    this test), the queue admits what fits its budget and drops (counts) the rest, each entry holds
    storage of its own (not the step's staging), and what is written is the request's K/V exactly."""
    tier = HeldTier()
    counters = Counters()
    saves = SaveQueue(TieredStore([tier]), budget_bytes=int(2.5 * step.entry_bytes), counters=counters, layout="t")
    try:
        saves.submit(step.ops, caches=step.caches, paged=step.paged)
        assert tier.entered.wait(60)  # the thread is inside the store's put, which does not return
        assert counters.total["dropped_saves"] == BLOCKS - 2 and saves.pending_bytes <= saves.budget_bytes
        saves.submit(step.ops, caches=step.caches, paged=step.paged)  # the budget is still held: all dropped
        assert counters.total["dropped_saves"] == 2 * BLOCKS - 2
    finally:
        tier.release.set()
        saves.close()
    assert tier.held == [step.entry_bytes, step.entry_bytes] and saves.pending_bytes == 0
    assert counters.total["saved_entries"] == 2 and counters.total["saved_tokens"] == 2 * BS
    for b in (0, 1):  # the first blocks are worth most: they were admitted
        got = tier.get(step.ops[b].key)
        assert torch.equal(got.tensors["k"], torch.stack([k[:, b * BS : (b + 1) * BS] for k, _ in step.kv]))
        assert torch.equal(got.tensors["v"], torch.stack([v[:, b * BS : (b + 1) * BS] for _, v in step.kv]))


def test_a_full_queue_evicts_the_saves_worth_least(step):
    """Writes held back (vLLM busy, no busy share: nothing is unpacked either): a later step's early block
    evicts the deepest staged step, a block deeper than everything queued is dropped itself, a step is
    evicted whole or not at all; at shutdown the rest is written."""
    pacer = Pacer(busy_share=0.0, quiet_s=1.0)
    pacer.step_began()  # a step that does not end: no turn until close()
    counters, tier = Counters(), HeldTier()
    tier.release.set()
    saves = SaveQueue(TieredStore([tier]), budget_bytes=3 * step.entry_bytes, counters=counters, layout="t",
                      pacer=pacer)
    try:
        saves.submit(step.ops[2:4], caches=step.caches, paged=step.paged)  # blocks 2, 3: one step
        saves.submit(step.ops[4:5], caches=step.caches, paged=step.paged)  # block 4: the budget is full
        assert counters.total["dropped_saves"] == 0
        saves.submit(step.ops[5:], caches=step.caches, paged=step.paged)  # deeper than all: dropped
        assert counters.total["dropped_saves"] == 1
        saves.submit(step.ops[:1], caches=step.caches, paged=step.paged)  # block 0 evicts block 4's step
        assert counters.total["dropped_saves"] == 2 and tier.calls == 0  # nothing written while busy
        saves.submit(step.ops[3:4], caches=step.caches, paged=step.paged)  # block 3 again: the step of 2 and 3
        assert counters.total["dropped_saves"] == 3  # is worth block 2's place: not evicted for a block 3
    finally:
        saves.close()
    assert [tier.contains(step.ops[b].key) for b in range(BLOCKS)] == [True, False, True, True, False, False]
    assert counters.total["saved_entries"] == 3 and saves.pending_bytes == 0


def test_a_failed_write_is_counted_and_the_next_ones_go_through(step):
    """The store refuses the first write: those saves are counted dropped, nothing raises into the
    step, and the next write is stored."""
    tier = HeldTier(fail_first=1)
    tier.release.set()
    counters = Counters()
    saves = SaveQueue(TieredStore([tier]), budget_bytes=64 * step.entry_bytes, counters=counters, layout="t")
    saves.submit(step.ops[:1], caches=step.caches, paged=step.paged)
    saves.close()  # flushes
    saves = SaveQueue(TieredStore([tier]), budget_bytes=64 * step.entry_bytes, counters=counters, layout="t")
    saves.submit(step.ops[1:2], caches=step.caches, paged=step.paged)
    saves.close()
    assert counters.total["dropped_saves"] == 1 and counters.total["saved_entries"] == 1
    assert not tier.contains(step.ops[0].key) and tier.contains(step.ops[1].key)


def test_the_pacer_writes_when_idle_and_a_share_of_the_time_when_busy():
    now = [100.0]
    p = Pacer(busy_share=0.1, quiet_s=0.05, clock=lambda: now[0])
    assert p.due(now[0]) == 0.0  # never a step: idle
    p.step_began()
    assert p.due(now[0]) == 0.0  # busy, but no busy write yet
    assert p.wait_turn()  # a busy turn
    p.spent(0.02)  # it took 20 ms: the next busy turn 180 ms later
    assert p.due(now[0]) == pytest.approx(0.18)
    p.step_ended()
    assert p.due(now[0]) == pytest.approx(0.05)  # idle after the quiet time, sooner than the busy turn
    now[0] += 0.05
    assert p.due(now[0]) == 0.0 and p.wait_turn()
    p.spent(1.0)  # an idle turn's write defers nothing
    p.step_began()
    assert p.due(now[0]) == pytest.approx(0.13)

    only_idle = Pacer(busy_share=0.0, quiet_s=0.05, clock=lambda: now[0])
    only_idle.step_began()
    assert only_idle.due(now[0]) is None  # not before the step ends
    only_idle.poke()
    assert only_idle.wait_turn() is False  # woken for new work, no turn
    only_idle.close()
    assert only_idle.due(now[0]) == 0.0 and only_idle.wait_turn()  # shutdown flushes at once


@pytest.mark.parametrize(("share", "quiet"), [(-0.1, 0.05), (1.5, 0.05), (0.1, -1.0)])
def test_the_pacer_refuses_nonsense(share, quiet):
    with pytest.raises(ValueError, match="busy_share"):
        Pacer(busy_share=share, quiet_s=quiet)


def test_a_span_saved_out_of_its_request_is_stored_at_positions_from_zero(step):
    """A save with a shift (a pic request's span the store lacked, saved out of the request that computed
    it at positions 70..): K is stored re-rotated by -70 (the torch reference), V as it is; without the
    model's RoPE geometry such a save is dropped and counted, never stored unrotated."""
    from contextkit.kernels.rerotate import rerotate_reference
    from contextkit.kernels.rope import RopeSpec

    rope = RopeSpec(head_dim=64, base=10000.0)
    tier = MemoryTier(1 << 30)
    s, e = 70, 150  # not block-aligned on either side
    span = SaveOp(ConnectorKey("ab" * 32, "salt.t", e - s), s, e, tuple(range(e - s)), (4, 1, 5, 0, 2, 3), shift=-s)
    for geometry in ([rope] * LAYERS, None):
        counters = Counters()
        saves = SaveQueue(TieredStore([tier]), budget_bytes=64 * step.entry_bytes, counters=counters, layout="t",
                          rope=geometry)
        saves.submit([span], caches=step.caches, paged=step.paged)
        saves.close()
        if geometry is None:
            assert counters.total["dropped_saves"] == 1 and counters.total["saved_entries"] == 0
            assert not tier.contains(span.key)
            continue
        got = tier.get(span.key)
        for li, (k, v) in enumerate(step.kv):
            want = rerotate_reference(k[:, s:e].float(), -s, rope).to(torch.bfloat16)
            assert (got.tensors["k"][li].float() - want.float()).abs().max() <= 0.02  # bf16 rounding
            assert torch.equal(got.tensors["v"][li], v[:, s:e])
        tier = MemoryTier(1 << 30)  # the dropped case must not find the first run's entry
