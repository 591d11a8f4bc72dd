"""The connector's scheduler side without a server: what a request asking for recompute loads, and what it
reports, on a server whose worker can repair and on one that cannot (its model runs on an accelerator); what
a request whose setting cannot be resolved gets (exact reuse, counted); how the operator's limits clamp and
shed repairs; and which calibration profile the connector finds for the model vLLM names.

Real pieces: vLLM's ``Request`` (its ``kv_transfer_params`` read from the sampling params' ``extra_args``,
as vLLM's API server passes them), a ``TieredStore`` over a memory tier holding span entries under the
keys the save thread uses, the options and salts the proxy derives (``core.policy``, ``core.tenancy``).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from contextkit.core.errors import ConfigError
from contextkit.core.models import WEIGHTS_DIGEST, weights_digest
from contextkit.core.policy import ReuseOptions, variant
from contextkit.core.tenancy import pic_salt
from contextkit.integrations.vllm_connector.connector import _local_model_dir, _profile, _repair_refused
from contextkit.integrations.vllm_connector.keys import KVGeometry, span_key
from contextkit.integrations.vllm_connector.scheduler import ConnectorScheduler
from contextkit.integrations.vllm_connector.settings import ConnectorSettings
from contextkit.integrations.vllm_connector.wire import PROTOCOL_VERSION, RequestOptions
from contextkit.kvstore.entry import make_entry
from contextkit.kvstore.memory import MemoryTier
from contextkit.kvstore.tiered import TieredStore
from contextkit.spans.calibration import Band, CalibrationProfile, Point, profile_path

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


def _request(rid: str, repair: ReuseOptions, *, version: int = PROTOCOL_VERSION) -> Request:
    ids = HEAD_IDS + SPANS[0] + SPANS[1] + QUESTION
    params = RequestOptions(mode="pic", spans=((32, 96), (96, 160)), salt=SALT, recompute=repair).encode()
    params["contextkit"]["v"] = version
    return Request(rid, ids, SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params}), None,
                   cache_salt=pic_salt(SALT, recompute_last=False, variant=variant(repair)))


def _scheduler(store, tmp_path, refused: str | None, *, profile: CalibrationProfile | None = None,
               step_tokens: int = 2048, **limits) -> ConnectorScheduler:
    settings = ConnectorSettings(disk_dir=tmp_path / "disk", cache_dir=tmp_path, **limits)
    return ConnectorScheduler(settings=settings, geometry=GEOM, store=store, pic_loads=True, repair_refused=refused,
                              profile=profile, step_tokens=step_tokens)


def _schedule(sched: ConnectorScheduler, reqs: list[Request]):
    """One scheduler step as vLLM's runs it for new requests with a 32-token local hit: each request's lookup
    and allocation, in turn, then the step's metadata. Returns what each loaded and the metadata."""
    loaded = []
    for req in reqs:
        n, _ = sched.get_num_new_matched_tokens(req, 32)
        sched.update_state_after_alloc(req, None, n)
        req.num_computed_tokens = 32 + n
        loaded.append(n)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData.from_request(r, (list(range(6)),)) for r in reqs]
    out.num_scheduled_tokens = {r.request_id: r.num_tokens - r.num_computed_tokens for r in reqs}
    return loaded, sched.build_connector_meta(out)


def _report(sched: ConnectorScheduler, req: Request) -> dict:
    return sched.request_finished(req, [])[1]["contextkit"]


def test_a_server_that_cannot_repair_loads_nothing_for_recompute_and_says_why(store, tmp_path):
    """Where the worker can repair, the stored spans load (and the repair is planned); where it cannot,
    the same request loads nothing (vLLM computes the span region: exact, never unrepaired KV the request
    did not ask for) and its answer reports policy "full", what was asked and why."""
    repair = ReuseOptions(policy="query_attention", ratio=0.3)
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


# -- a setting that cannot be resolved: exact reuse, counted, never an error in vLLM's scheduler -------------
def _hostile_profile() -> CalibrationProfile:
    """A profile as one that got past its checks would be (built in memory, not read from a file): its only
    setting has a ratio no recompute can run, which raised inside vLLM's scheduler on the first budget request."""
    point = Point(1.5, (0.01,) * 19, (1.0,) * 19, 3.0)
    return CalibrationProfile("ab" * 32, "bfloat16", 0.9, 32, "hand-made", (Band("short", 170, (point,)),))


@pytest.mark.parametrize("case", ["bad profile", "fractional first_k"])
def test_a_setting_that_cannot_be_resolved_runs_as_exact_reuse_and_is_counted(store, tmp_path, caplog, case):
    """Both requests would raise inside vLLM's scheduler before: choosing with the bad profile, or planning
    the load's sinks (range() of a float) when the step's metadata is built. Now each runs as exact prefix
    reuse (nothing of it loads as spans), the fallback is counted where vLLM reads the connector's counters,
    and the warning names the request, not its tenant."""
    if case == "bad profile":
        sched, repair = _scheduler(store, tmp_path, None, profile=_hostile_profile()), ReuseOptions()
    else:
        sched, repair = _scheduler(store, tmp_path, None), ReuseOptions(policy="query_attention", first_k=2.5)
    req = _request("req-7", repair)
    with caplog.at_level(logging.WARNING, logger="contextkit.connector"):
        loaded, meta = _schedule(sched, [req])
    assert loaded == [0] and not meta.loads
    out = _report(sched, req)
    assert out["mode"] == "exact" and "recompute" not in out
    assert any("req-7" in m and "exact prefix reuse" in m and SALT not in m for m in caplog.messages)
    assert sched.counters.take().data["policy_fallbacks"] == 1
    ok = _request("req-8", ReuseOptions(policy="query_attention", ratio=0.3))  # the next request is unaffected
    assert _schedule(sched, [ok])[0] == [128] and sched.counters.take() is None


# -- the operator's limits ------------------------------------------------------------------------------
def test_the_default_limits_leave_the_default_settings_alone(store, tmp_path):
    # the cost gate off: on this two-layer model kv_deviation's pass over the context runs through every
    # layer, so its repair does cost more than the region it loads (the gate's own test is below)
    sched = _scheduler(store, tmp_path, None, repair_token_cost=0)
    reqs = [_request(f"d{i}", r) for i, r in enumerate((ReuseOptions(), ReuseOptions(policy="kv_deviation"),
                                                       ReuseOptions(policy="query_attention", ratio=0.7)))]
    loaded, meta = _schedule(sched, reqs)
    assert loaded == [128] * 3
    assert [op.repair.count for op in meta.loads] == [38, 38, 90]  # round(r x 128 moved tokens), besides 4 sinks
    for req in reqs:
        assert "clamped" not in _report(sched, req)["recompute"]
    assert sched.counters.take() is None


def test_a_ratio_over_the_limit_is_clamped_and_reported(store, tmp_path):
    sched = _scheduler(store, tmp_path, None, max_recompute_ratio=0.3)
    req = _request("r1", ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=10_000, probe_layers=0))
    loaded, meta = _schedule(sched, [req])
    assert loaded == [128] and meta.loads[0].repair.count == 38 and len(meta.loads[0].repair.sinks) == 4
    report = _report(sched, req)["recompute"]
    assert report["clamped"] is True and report["limits"] == {"max_recompute_ratio": 0.3}
    assert report["ratio"] == 0.3 and report["recomputed_tokens"] == 42
    assert sched.counters.take().data["repair_clamps"] == 1


def test_a_request_recomputes_at_most_max_recompute_tokens(store, tmp_path):
    sched = _scheduler(store, tmp_path, None, max_recompute_tokens=20)
    req = _request("r1", ReuseOptions(policy="query_attention", ratio=0.5, max_recompute=10_000))
    _, meta = _schedule(sched, [req])
    plan = meta.loads[0].repair
    assert len(plan.sinks) == 4 and plan.count == 16  # the sinks kept, the chosen cut to the rest
    report = _report(sched, req)["recompute"]
    assert report["recomputed_tokens"] == 20 and report["limits"] == {"max_recompute_tokens": 20}
    greedy = _request("r2", ReuseOptions(policy="first_k", first_k=64))  # 128 sinks: no cut can keep them
    assert _schedule(sched, [greedy])[0] == [0]
    report = _report(sched, greedy)["recompute"]
    assert report["policy"] == "full" and "max_recompute_tokens" in report["reason"]


def test_a_repair_past_the_steps_budget_is_shed_to_a_full_prefill_and_counted(store, tmp_path):
    """Each repair here: 4 sinks + 38 chosen + the probe over the 10 question tokens through both layers =
    52 tokens of work. Two fit a step of 110; the third is shed (loads nothing: vLLM computes its spans); the
    next step has a budget of its own."""
    sched = _scheduler(store, tmp_path, None, max_step_recompute_tokens=110)
    reqs = [_request(f"s{i}", ReuseOptions(policy="query_attention", ratio=0.3, probe_layers=0)) for i in range(3)]
    loaded, meta = _schedule(sched, reqs)
    assert loaded == [128, 128, 0] and [op.req_id for op in meta.loads] == ["s0", "s1"]
    shed = _report(sched, reqs[2])
    assert shed["loaded_tokens"] == 0 and shed["recompute"]["policy"] == "full"
    assert shed["recompute"]["requested"] == "query_attention" and shed["recompute"]["recomputed_tokens"] == 0
    assert "max_step_recompute_tokens (110)" in shed["recompute"]["reason"]
    assert sched.counters.take().data["repair_sheds"] == 1
    again = _request("s3", ReuseOptions(policy="query_attention", ratio=0.3, probe_layers=0))
    assert _schedule(sched, [again])[0] == [128]


def test_the_steps_repair_budget_defaults_to_the_servers_step_budget(store, tmp_path):
    """Unset, ``max_step_recompute_tokens`` is vLLM's ``max_num_batched_tokens``: with a server step of 110
    tokens the same three repairs of 52 tokens' work as above fit two to a step; set, the setting wins."""
    reqs = [_request(f"d{i}", ReuseOptions(policy="query_attention", ratio=0.3, probe_layers=0)) for i in range(3)]
    assert _schedule(_scheduler(store, tmp_path, None, step_tokens=110), reqs)[0] == [128, 128, 0]
    reqs = [_request(f"e{i}", ReuseOptions(policy="query_attention", ratio=0.3, probe_layers=0)) for i in range(3)]
    assert _schedule(_scheduler(store, tmp_path, None, step_tokens=110, max_step_recompute_tokens=200),
                     reqs)[0] == [128, 128, 128]


def test_a_repair_over_the_memory_limit_is_shed(store, tmp_path):
    """The repair's cache holds the prompt (170 tokens) and a copy of the 32-token prefix: 2 (K, V) x 2 layers
    x 2 heads x 64 x 2 bytes + 16 a token, 210,080 bytes."""
    req = _request("m1", ReuseOptions(policy="query_attention", ratio=0.3))
    assert _schedule(_scheduler(store, tmp_path, None, max_repair_bytes=210_080), [req])[0] == [128]
    sched = _scheduler(store, tmp_path, None, max_repair_bytes=210_079)
    req = _request("m2", ReuseOptions(policy="query_attention", ratio=0.3))
    assert _schedule(sched, [req])[0] == [0]
    assert "max_repair_bytes" in _report(sched, req)["recompute"]["reason"]


@pytest.mark.parametrize("bad", [{"max_recompute_ratio": 1.5}, {"max_recompute_ratio": "0.3"},
                                 {"max_recompute_tokens": 0}, {"max_step_recompute_tokens": -1},
                                 {"max_repair_bytes": 1.5}, {"repair_chunk_tokens": 0}])
def test_limits_out_of_range_are_refused_at_start(tmp_path, bad):
    with pytest.raises(ConfigError, match=next(iter(bad))):
        ConnectorSettings(disk_dir=tmp_path / "disk", cache_dir=tmp_path, **bad)


# -- which calibration profile the connector finds -----------------------------------------------------
def _calibrated(model_dir, digest: str) -> CalibrationProfile:
    point = Point(0.3, (0.01,) * 19, (1.0,) * 19, 2.0)
    profile = CalibrationProfile(digest, "bfloat16", 0.9, 32, "hand-made", (Band("short", 170, (point,)),))
    profile_path(model_dir, "bfloat16").write_text(profile.to_json())
    return profile


def test_a_hub_id_is_looked_up_in_its_local_snapshot(tmp_path):
    """vLLM names a hub model by its id (``--model org/name``) and reads it from the Hugging Face cache (its
    ``--download-dir`` here): the profile beside the snapshot's weights is the one used."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny"
    snap = repo / "snapshots" / ("c0" * 20)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("c0" * 20)
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"weights")
    profile = _calibrated(snap, weights_digest(snap))
    assert _local_model_dir("org/tiny", download_dir=str(cache)) == snap
    assert _profile(_local_model_dir("org/tiny", download_dir=str(cache)), "bfloat16") == profile
    # the first_k series, calibrated on spans compiled alone, is left out where spans load as KV saved in
    # their first request's context (the default), kept where every span is compiled alone
    kept = dataclasses.replace(profile.bands[0].points[0], first_k=32, ratio=0.0, speedup=9.0, policy="first_k")
    both = dataclasses.replace(profile, bands=(dataclasses.replace(profile.bands[0],
                                                                   points=(*profile.bands[0].points, kept)),))
    profile_path(snap, "bfloat16").write_text(both.to_json())
    assert _profile(snap, "bfloat16") == profile and profile.choose(0.1, 170).options.policy == "query_attention"
    assert _profile(snap, "bfloat16", context_spans=False) == both
    assert both.choose(0.1, 170).options.policy == "first_k"
    # a profile calibrated on KV saved in context (calibrate --set kv_source=context) is the one the connector
    # uses while context_spans is on, whole; the compiled one where every span is compiled alone
    deviation = dataclasses.replace(profile.bands[0].points[0], ratio=0.2, speedup=4.0, policy="kv_deviation",
                                    probe_layers=None)
    context = dataclasses.replace(profile, kv_source="context", bands=(dataclasses.replace(
        profile.bands[0], points=(deviation,)),))
    profile_path(snap, "bfloat16", "context").write_text(context.to_json())
    assert _profile(snap, "bfloat16") == context and context.choose(0.1, 170).options.policy == "kv_deviation"
    assert _profile(snap, "bfloat16", context_spans=False) == both
    assert _local_model_dir("org/absent", download_dir=str(cache)) is None
    assert _profile(None, "bfloat16") is None


def test_a_digest_sidecar_without_weights_is_not_trusted(tmp_path):
    """A directory holding no weights, with a sidecar naming some model's digest and a profile for it: the
    sidecar's digest was trusted (it matched the stamp of no files), and that profile used."""
    fake = tmp_path / "org" / "tiny"
    fake.mkdir(parents=True)
    digest = "ab" * 32
    (fake / WEIGHTS_DIGEST).write_text(json.dumps({"sha256": digest, "files": {}}))
    _calibrated(fake, digest)
    assert weights_digest(fake) != digest
    assert _profile(fake, "bfloat16") is None
    assert json.loads((fake / WEIGHTS_DIGEST).read_text())["sha256"] == digest  # nothing written there either


def test_a_request_of_another_wire_version_runs_as_exact_reuse_and_is_counted(store, tmp_path, caplog):
    """A proxy of another release sends params of another version: the connector reads none of them (no
    span loads, no recompute), runs the request as exact reuse, says why and counts it."""
    sched = _scheduler(store, tmp_path, None)
    req = _request("req-v2", ReuseOptions(policy="query_attention"), version=PROTOCOL_VERSION + 1)
    with caplog.at_level(logging.WARNING, logger="contextkit.connector"):
        loaded, meta = _schedule(sched, [req])
    assert loaded == [0] and not meta.loads
    out = _report(sched, req)
    assert out["mode"] == "exact" and "recompute" not in out and out["v"] == PROTOCOL_VERSION
    assert any("req-v2" in m and "same contextkit release" in m for m in caplog.messages)
    assert sched.counters.take().data["wire_mismatches"] == 1


def test_a_gated_budget_carries_its_tail_gate_to_the_worker_and_the_report(store, tmp_path):
    """policy="budget" resolved by a profile whose setting holds the budget only with a tail gate: the step's
    repair plan carries the gate (the worker escalates past it) and the request's report names it."""
    kl = (0.01,) * 17 + (0.5, 0.5)
    point = Point(0.2, kl, tuple(1 - k for k in kl), 3.0, probe_layers=0, shift=(0.3,) * 17 + (0.9, 0.9))
    profile = CalibrationProfile("ab" * 32, "bfloat16", 0.9, 32, "hand-made", (Band("short", 170, (point,)),))
    assert profile.choose(0.05, 170).tail_gate == 0.3
    sched = _scheduler(store, tmp_path, None, profile=profile)
    req = _request("g1", ReuseOptions(fidelity_budget=0.05))
    loaded, meta = _schedule(sched, [req])
    assert loaded == [128] and meta.loads[0].repair.tail_gate == 0.3
    report = _report(sched, req)["recompute"]
    assert report["tail_gate"] == 0.3 and report["policy"] == "query_attention" and report["ratio"] == 0.2


def test_a_budget_that_chooses_first_k_repairs_only_each_spans_first_tokens(store, tmp_path):
    """policy="budget" resolved by a profile whose fastest setting within the budget is first_k alone: the
    repair plan recomputes each loaded span's first k tokens and nothing else (no probe), and the report
    says which k ran."""
    kl = (0.01,) * 19
    point = Point(0.0, kl, (1.0,) * 19, 3.0, first_k=16, policy="first_k")
    profile = CalibrationProfile("ab" * 32, "bfloat16", 0.9, 32, "hand-made", (Band("short", 170, (point,)),))
    sched = _scheduler(store, tmp_path, None, profile=profile)
    req = _request("k1", ReuseOptions(fidelity_budget=0.05))
    loaded, meta = _schedule(sched, [req])
    repair = meta.loads[0].repair
    assert loaded == [128] and repair.policy == "first_k" and repair.count == 0
    assert len(repair.sinks) == sum(min(16, n) for _, n, src in repair.pieces if src == 0) > 0
    report = _report(sched, req)["recompute"]
    assert (report["policy"], report["ratio"], report["first_k"]) == ("first_k", 0.0, 16)
    assert "probe_layers" not in report and report["recomputed_tokens"] == len(repair.sinks)


def test_a_repair_that_costs_more_than_the_region_it_loads_is_skipped_and_counted(store, tmp_path):
    """first_k at k = 64 over two 64-token spans recomputes all 128 tokens it loads: vLLM computes them for
    less, so the request loads nothing and says why (no limit was broken: not a shed). At repair_token_cost
    0 the operator turns the gate off; at a measured 4.0, a 32-token repair of the same load is skipped too."""
    sched = _scheduler(store, tmp_path, None)
    req = _request("c1", ReuseOptions(policy="first_k", first_k=64))
    loaded, meta = _schedule(sched, [req])
    assert loaded == [0] and not meta.loads
    report = _report(sched, req)["recompute"]
    assert report["policy"] == "full" and report["requested"] == "first_k" and report["recomputed_tokens"] == 0
    assert report["reason"].startswith("skipped:") and "128 tokens it loads" in report["reason"]
    counts = sched.counters.take().data
    assert counts["repair_skips"] == 1 and counts["repair_sheds"] == 0
    off = _scheduler(store, tmp_path, None, repair_token_cost=0)
    assert _schedule(off, [_request("c2", ReuseOptions(policy="first_k", first_k=64))])[0] == [128]
    dear = _scheduler(store, tmp_path, None, repair_token_cost=4.0)
    assert _schedule(dear, [_request("c3", ReuseOptions(policy="first_k", first_k=16))])[0] == [0]
    assert _schedule(sched, [_request("c4", ReuseOptions(policy="first_k", first_k=16))])[0] == [128]
    for bad in (-1, "1", float("nan"), 1000):
        with pytest.raises(ConfigError, match="repair_token_cost"):
            ConnectorSettings(disk_dir=tmp_path / "disk", repair_token_cost=bad)
