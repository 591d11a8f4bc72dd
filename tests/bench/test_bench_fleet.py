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


def test_bench_fleet_given_servers_need_their_event_endpoints(tmp_path, cli, trace_requests, one_line_error):
    """``--set upstreams`` without one publisher and one replay endpoint per server: one error line that says
    what to give, before any server is reached (the live arms' run on given servers: tests/integrations/proxy/
    test_fleet.py)."""
    trace = tmp_path / "trace.jsonl"
    write_trace(trace_requests(1), trace)
    proc = cli("bench", "fleet", "--trace", str(trace), "--n", "2", "--set", "upstreams=http://127.0.0.1:9,"
               "http://127.0.0.1:10", "--set", "upstream_events=ipc:///tmp/a,ipc:///tmp/b")
    one_line_error(proc, "--set upstream_events", "2 servers", "PUB,REPLAY")
