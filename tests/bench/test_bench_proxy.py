"""``contextkit bench proxy`` end to end on a tiny stream against the real vLLM server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextkit.bench.workload import write_trace

pytestmark = pytest.mark.slow


def test_bench_proxy_small_run(tmp_path, vllm_url, cli, trace_requests):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "proxy.json"
    write_trace(trace_requests(2), trace)
    proc = cli("bench", "proxy", "--upstream", vllm_url, "--trace", str(trace), "--n", "4", "--json", str(out),
               "--set", "concurrency=1,4", "--set", "requests_per_level=4", "--set", "soak_s=3",
               "--set", "max_tokens=2", "--set", "repeats=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    phases = [r["phase"] for r in result["rows"]]
    assert phases == ["overhead"] * 3 + ["A/A control", "documents", "documents", "soak"]
    assert [r.get("repeat") for r in result["rows"][:3]] == [None, 1, 2]  # the top level, run twice
    for row in result["rows"][:3]:
        # every proxied request's own timings were found in the proxy's access log, and the client's
        # interval contains the proxy's upstream interval (one monotonic clock), so the overhead is >= 0
        assert row["matched"] == row["requests"] == 4
        assert 0 <= row["overhead_ms_p50"] <= row["overhead_ms_p99"]
        # the proxy's own part (arrival to forwarding upstream) lies inside the overhead the client saw,
        # request by request, so its median does too (0.01: both are rounded to 3 decimals)
        assert row["proxy_ms_p50"] is not None and row["proxy_ms_p50"] <= row["overhead_ms_p50"] + 0.01
        assert row["proxy_cpu_ms_per_request"] is not None  # read from the proxy's /proc (10 ms ticks: may be 0)
    s = result["summary"]
    assert {"overhead_ms_p50", "overhead_ms_p99", "errors", "docs_ttft_reduction_vs_direct", "rss_growth"} <= set(s)
    assert s["errors"] == 0 and s["soak_requests"] > 0
    assert s["overhead_ms_p99_min"] <= s["overhead_ms_p99"] <= s["overhead_ms_p99_max"]
    assert len(s["overhead_ms_p99_runs"]) == 2


def test_cores_split_between_engine_and_proxy(monkeypatch):
    import os

    from contextkit.bench.host import split_cpus as _split_cpus
    from contextkit.core.errors import ConfigError
    from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert _split_cpus(True, "", starting_engine=True) == ((0, 1, 2), (3,))
    assert _split_cpus(True, "", starting_engine=False) == ((), ())  # someone else's server: leave it
    assert _split_cpus(True, "1,2", starting_engine=True) == ((0, 3), (1, 2))
    assert _split_cpus(False, "1", starting_engine=True) == ((), ())
    with pytest.raises(ConfigError, match="proper subset"):
        _split_cpus(True, "0,1,2,3", starting_engine=True)
    with pytest.raises(ConfigError, match="comma list"):
        _split_cpus(True, "last", starting_engine=True)
    server = VLLMServer(VLLMServerConfig(model_dir=Path("/m"), cpus=(1, 2)))
    assert server.command()[:3] == ["taskset", "-c", "1,2"]
    with pytest.raises(ConfigError, match="not available"):
        VLLMServerConfig(model_dir=Path("/m"), cpus=(7,))
