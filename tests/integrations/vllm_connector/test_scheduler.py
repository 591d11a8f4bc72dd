"""The connector's scheduler side without a server: what a request asking for recompute loads, and what it
reports, on a server whose worker can repair and on one that cannot (its model runs on an accelerator).

Real pieces: vLLM's ``Request`` (its ``kv_transfer_params`` read from the sampling params' ``extra_args``,
as vLLM's API server passes them), a ``TieredStore`` over a memory tier holding span entries under the
keys the save thread uses, the options and salts the proxy derives (``core.repair``, ``core.tenancy``).
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.request import Request

from contextkit.core.repair import RepairOptions
from contextkit.core.tenancy import pic_salt
from contextkit.integrations.vllm_connector.connector import _repair_refused
from contextkit.integrations.vllm_connector.keys import KVGeometry, span_key
from contextkit.integrations.vllm_connector.scheduler import ConnectorScheduler
from contextkit.integrations.vllm_connector.settings import ConnectorSettings
from contextkit.kvstore.entry import make_entry
from contextkit.kvstore.memory import MemoryTier
from contextkit.kvstore.tiered import TieredStore

BS, LAYERS, HEADS, HEAD = 32, 2, 2, 64
GEOM = KVGeometry("m", "bfloat16", BS, LAYERS, HEADS, HEAD)
SALT = "tenant-a"
HEAD_IDS, SPANS, QUESTION = list(range(1, 33)), [list(range(100, 164)), list(range(200, 264))], list(range(300, 310))


@pytest.fixture
def store():
    s = TieredStore([MemoryTier(1 << 28)])
    for ids in SPANS:  # each span stored as the save thread stores it: position-free, under the tenant's salt
        key = span_key(GEOM, SALT, ids)
        k, v = (torch.zeros(LAYERS, HEADS, len(ids), HEAD, dtype=torch.bfloat16) for _ in range(2))
        s.put(key, make_entry(key, {"k": k, "v": v, "ids": torch.tensor(ids)}, GEOM.layout()))
    return s


def _request(rid: str, repair: RepairOptions) -> Request:
    ids = HEAD_IDS + SPANS[0] + SPANS[1] + QUESTION
    spans = [[32, 96], [96, 160]]
    params = {"contextkit": {"mode": "pic", "spans": spans, "salt": SALT, "recompute_last": False,
                             "recompute": repair.wire()}}
    return Request(rid, ids, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None,
                   cache_salt=pic_salt(SALT, recompute_last=False, variant=repair.variant))


def _scheduler(store, tmp_path, refused: str | None) -> ConnectorScheduler:
    settings = ConnectorSettings(disk_dir=tmp_path / "disk", cache_dir=tmp_path)
    return ConnectorScheduler(settings=settings, geometry=GEOM, store=store, pic_loads=True, repair_refused=refused)


def test_a_server_that_cannot_repair_loads_nothing_for_recompute_and_says_why(store, tmp_path):
    """Where the worker can repair, the stored spans load (and the repair is planned); where it cannot,
    the same request loads nothing (vLLM computes the span region: exact, never unrepaired KV the request
    did not ask for) and its answer reports policy "full", what was asked and why."""
    repair = RepairOptions.of({"policy": "query_attention", "ratio": 0.3})
    able = _scheduler(store, tmp_path, None)
    req = _request("r1", repair)
    loaded, _ = able.get_num_new_matched_tokens(req, 32)
    assert loaded == 128  # both spans, after the 32-token local prefix hit
    reason = _repair_refused("cuda")
    unable = _scheduler(store, tmp_path, reason)
    req = _request("r2", repair)
    assert unable.get_num_new_matched_tokens(req, 32) == (0, False)
    _, out = unable.request_finished(req, [])
    report = out["contextkit"]["recompute"]
    assert report["policy"] == "full" and report["requested"] == "query_attention"
    assert report["reason"] == reason and report["recomputed_tokens"] == 0
    assert out["contextkit"]["loaded_tokens"] == 0


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_cpu_servers_repair(device):
    assert _repair_refused(device) is None


@pytest.mark.parametrize("device", ["cuda", "cuda:1", "xpu", "tpu"])
def test_accelerator_servers_refuse_with_the_way_out(device):
    reason = _repair_refused(device)
    assert reason and device.split(":")[0] in reason and "policy none" in reason
