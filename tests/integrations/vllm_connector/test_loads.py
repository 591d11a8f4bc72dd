"""The connector's loads without a server: ``ConnectorWorker.start_load_kv`` writes stored entries into a
paged cache packed by vLLM's own CPU op, exact blocks at their positions and spans re-rotated to theirs.

Real pieces: ``PagedKV`` over vLLM's op, a ``TieredStore`` over a memory tier holding entries made as the
save thread makes them, the worker's own rotation kernel. What the cache holds afterwards is read back by
``PagedKV.read`` (the reference reader) and compared with the torch reference rotation.
"""

from __future__ import annotations

import pytest
import torch

from contextkit.integrations.vllm_connector.keys import ConnectorKey, KVGeometry
from contextkit.integrations.vllm_connector.lookup import Piece
from contextkit.integrations.vllm_connector.metadata import ConnectorMeta, LoadOp
from contextkit.integrations.vllm_connector.paged import slots_of
from contextkit.integrations.vllm_connector.settings import ConnectorSettings
from contextkit.integrations.vllm_connector.worker import ConnectorWorker
from contextkit.kernels.rerotate import rerotate_reference
from contextkit.kernels.rope import RopeSpec
from contextkit.kvstore.entry import make_entry
from contextkit.kvstore.memory import MemoryTier
from contextkit.kvstore.tiered import TieredStore

BS, LAYERS, HEADS, HEAD, BLOCKS = 32, 3, 2, 64, 24
GEOM = KVGeometry("m", "bfloat16", BS, LAYERS, HEADS, HEAD)
ROPE = RopeSpec(head_dim=HEAD, base=10000.0)


@pytest.fixture
def worker(tmp_path):
    store = TieredStore([MemoryTier(1 << 30)])
    w = ConnectorWorker(settings=ConnectorSettings(disk_dir=tmp_path / "disk", cache_dir=tmp_path), geometry=GEOM,
                        store=store, rope=[ROPE] * LAYERS)
    w.register_kv_caches({f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, HEADS, BS, 2 * HEAD,
                                                                           dtype=torch.bfloat16)
                          for i in range(LAYERS)})
    yield w
    w.shutdown()


def _stored(worker, name: str, ids: list[int], seed: int):
    """An entry of ``ids`` (K and V as the save thread stores them) put in the worker's store."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(LAYERS, HEADS, len(ids), HEAD, generator=g).to(torch.bfloat16) for _ in range(2))
    key = ConnectorKey(f"{seed:064x}", "salt.t", len(ids))
    worker.store.put(key, make_entry(key, {"k": k, "v": v, "ids": torch.tensor(ids)}, GEOM.layout()))
    return key, k, v


def _cache_kv(worker, slots: torch.Tensor):
    """Each layer's K and V at ``slots``, ``(heads, n, head)``, read back from the paged cache."""
    return [worker._paged.read(cache, slots) for _, cache in worker._caches]


def test_blocks_load_in_place_and_spans_load_re_rotated(worker):
    """An exact block lands as stored; a span stored at positions 0.. and written at 2*BS.. lands with K
    re-rotated by 2*BS (the torch reference) and V as stored; then a longer load (the reused buffer grows)
    and a shorter one (it is reused) land as exactly."""
    ids = list(range(1000, 1000 + 5 * BS))
    table = (7, 3, 11, 0, 20)  # the request's blocks, out of order
    for rep, n_blocks in enumerate((3, 5, 2)):
        block, kb, vb = _stored(worker, f"b{rep}", ids[:BS], seed=10 * rep)
        span_ids = ids[BS : n_blocks * BS]
        span, ks, vs = _stored(worker, f"s{rep}", span_ids, seed=10 * rep + 1)
        pieces = (Piece(block, 0, BS, 0, tuple(ids[:BS])),
                  Piece(span, 0, len(span_ids), BS, tuple(span_ids), shift=BS))
        op = LoadOp("r", 0, n_blocks * BS, pieces, table)
        worker.start_load_kv(ConnectorMeta(loads=[op]))
        got = _cache_kv(worker, slots_of(list(table), BS, 0, n_blocks * BS))
        for li, (k, v) in enumerate(got):
            assert torch.equal(k[:, :BS], kb[li]) and torch.equal(v[:, :BS], vb[li])
            want = rerotate_reference(ks[li].float(), BS, ROPE).to(torch.bfloat16)
            assert (k[:, BS:].float() - want.float()).abs().max() <= 0.02  # bf16 rounding of the same rotation
            assert torch.equal(v[:, BS:], vs[li])
    assert worker.counters.total["load_failures"] == 0
    assert worker.counters.total["span_tokens"] == (2 + 4 + 1) * BS  # the spans of the three loads


def test_an_entry_that_does_not_match_is_not_loaded_and_its_blocks_are_recomputed(worker):
    """A piece whose entry holds other token ids stops the load there: the pieces before it are written,
    its blocks and those after are reported to vLLM (which recomputes them), and the failure is counted."""
    ids = list(range(5000, 5000 + 3 * BS))
    table = (1, 2, 4)
    keys = [_stored(worker, f"x{i}", ids[i * BS : (i + 1) * BS], seed=100 + i) for i in range(3)]
    wrong = list(ids[BS : 2 * BS])
    wrong[5] += 1  # the request has another token there than the stored block
    pieces = (Piece(keys[0][0], 0, BS, 0, tuple(ids[:BS])), Piece(keys[1][0], 0, BS, BS, tuple(wrong)),
              Piece(keys[2][0], 0, BS, 2 * BS, tuple(ids[2 * BS :])))
    worker.start_load_kv(ConnectorMeta(loads=[LoadOp("r", 0, 3 * BS, pieces, table)]))
    assert worker.get_block_ids_with_load_errors() == {2, 4}
    assert worker.counters.total["load_failures"] == 1
    k, v = _cache_kv(worker, slots_of(list(table), BS, 0, BS))[0]
    assert torch.equal(k, keys[0][1][0]) and torch.equal(v, keys[0][2][0])
    assert worker.counters.total["loaded_tokens"] == BS


@pytest.mark.parametrize("repairer", ["none", "sliding-window model"])
def test_a_repair_that_cannot_run_leaves_the_span_region_to_vllm(worker, gemma_dir, repairer):
    """A pic load that asks for recompute, where the repair raises (no repairer; a model it refuses): nothing
    of the region is written, its blocks are reported (vLLM computes them in full) and the failure counted;
    the exact block before it, loaded by another op of the step, still lands."""
    from contextkit.integrations.vllm_connector.metadata import RepairPlan
    from contextkit.integrations.vllm_connector.repair import Repairer

    worker._repairer = None if repairer == "none" else Repairer(model_dir=gemma_dir, dtype="bfloat16")
    ids = list(range(7000, 7000 + 3 * BS))
    table = (5, 6, 9)
    span, ks, _ = _stored(worker, "rs", ids[BS:], seed=300)
    before = _cache_kv(worker, slots_of(list(table), BS, BS, 3 * BS))
    plan = RepairPlan("query_attention", 10, (BS, BS + 1), ((BS, 2 * BS, 0),), tuple(ids), 8, 1)
    op = LoadOp("r", BS, 3 * BS, (Piece(span, 0, 2 * BS, BS, tuple(ids[BS:]), shift=BS),), table, plan)
    worker.start_load_kv(ConnectorMeta(loads=[op]))
    assert worker.get_block_ids_with_load_errors() == {6, 9}
    assert worker.counters.total["repair_failures"] == 1 and worker.counters.total["repairs"] == 0
    after = _cache_kv(worker, slots_of(list(table), BS, BS, 3 * BS))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))


def test_a_load_over_the_tail_gate_is_left_to_vllm_and_counted_as_an_escalation(worker, monkeypatch):
    """The repairer's ``TailEscalated`` (the repair read the request as its setting's tail): the region's
    blocks are reported to vLLM, nothing of it written, counted as a tail escalation, not a failure."""
    from contextkit.integrations.vllm_connector.metadata import RepairPlan
    from contextkit.integrations.vllm_connector.repair import Repairer, TailEscalated

    class OverTheGate(Repairer):  # the real class; its run stops where the gate stops it
        def run(self, plan, **_):
            raise TailEscalated(f"the repair moved the recomputed keys by 0.9, over the profile's tail gate "
                                f"{plan.tail_gate}")

    worker._repairer = OverTheGate(model_dir="unused", dtype="bfloat16")
    ids = list(range(9000, 9000 + 3 * BS))
    table = (2, 8, 10)
    span, _, _ = _stored(worker, "tg", ids[BS:], seed=400)
    before = _cache_kv(worker, slots_of(list(table), BS, BS, 3 * BS))
    plan = RepairPlan("query_attention", 10, (BS, BS + 1), ((BS, 2 * BS, 0),), tuple(ids), 8, 1, tail_gate=0.2)
    op = LoadOp("r", BS, 3 * BS, (Piece(span, 0, 2 * BS, BS, tuple(ids[BS:]), shift=BS),), table, plan)
    worker.start_load_kv(ConnectorMeta(loads=[op]))
    assert worker.get_block_ids_with_load_errors() == {8, 10}
    totals = worker.counters.total
    assert totals["tail_escalations"] == 1 and totals["repair_failures"] == 0 and totals["repairs"] == 0
    after = _cache_kv(worker, slots_of(list(table), BS, BS, 3 * BS))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(before, after))
