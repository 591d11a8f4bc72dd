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
