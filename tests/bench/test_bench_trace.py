"""``contextkit bench trace`` end to end on a tiny trace: vLLM direct and behind the proxy, serve three ways."""

from __future__ import annotations

import json

import pytest

from contextkit.bench.workload import write_trace

pytestmark = pytest.mark.slow


def test_bench_trace_small_run(tmp_path, vllm_url, cli, trace_requests):
    """What CI runs of bench trace (DEVELOPERS.md, "What CI runs of each bench"): every arm but the connector's,
    which starts a vLLM of its own to run what bench connector's recompute rows and the connector's tests
    through the proxy (tests/integrations/vllm_connector) already run."""
    trace, out = tmp_path / "trace.jsonl", tmp_path / "trace.json"
    requests = trace_requests(2)
    write_trace(requests, trace)  # per item: its passages, then the same set in another order
    proc = cli("bench", "trace", "--upstream", vllm_url, "--trace", str(trace), "--json", str(out),
               "--set", "max_tokens=3", "--set", "connector_arm=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["arm"]: r for r in result["rows"]}
    assert set(rows) == {"vllm direct (retrieval order)", "proxy + vllm (weaver)", "serve, span reuse (default)",
                         "serve, no idle compile (--no-compile-idle)", "serve, full prefill"}
    assert all(r["requests"] == 4 and r["ttft_ms_p50"] > 0 for r in rows.values())
    prefix = rows["serve, no idle compile (--no-compile-idle)"]
    # serve orders a document set as it served it before, so the second request of each item reuses
    # the system prompt and its documents as an exact prefix, with nothing compiled position-free; where
    # items share documents (the bundled example, rotated per item, in a clone without the shared data),
    # a later item reuses them from the KV an earlier one computed, re-positioned: more than exact
    items = [{d.text for d in r.documents} for r in requests[::2]]
    if any(a & b for i, a in enumerate(items) for b in items[i + 1:]):
        assert 0 < prefix["exact_share"] < prefix["reused_share"]
    else:
        assert 0 < prefix["exact_share"] == prefix["reused_share"]
    reuse = rows["serve, span reuse (default)"]
    assert reuse["reused_share"] >= reuse["exact_share"] > 0
    s = result["summary"]
    assert s["requests"] == 4
    assert s["trace_ttft_vs_vllm_proxy"] == round(s["serve_ttft_ms_p50"] / s["proxy_ttft_ms_p50"], 3)
    assert 0 <= s["serve_answer_agreement_f1"] <= 1
    assert s["connector_ttft_vs_serve"] is None  # the arm did not run
