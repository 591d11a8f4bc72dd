"""``contextkit bench connector`` end to end on a tiny trace: its own vLLM servers and the test Redis."""

from __future__ import annotations

import json

import pytest

from contextkit.bench.workload import write_trace

pytestmark = pytest.mark.slow


def test_bench_connector_small_run(tmp_path, redis_url, cli, trace_requests):
    """What CI runs of bench connector (DEVELOPERS.md, "What CI runs of each bench"): every row but the
    restart's and the second server's (``--set store_rows=0``: tests/integrations/vllm_connector/ runs both
    paths), on two requests (one item in two orders); its server is most of the time."""
    trace, out = tmp_path / "trace.jsonl", tmp_path / "connector.json"
    write_trace(trace_requests(1), trace)
    proc = cli("bench", "connector", "--trace", str(trace), "--n", "2", "--json", str(out),
               "--set", f"redis={redis_url}", "--set", "store_rows=0", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["full prefill (cold)", "prefix caching", "prefix caching, connector saving",
                          "local prefix hit (floor)",
                          "span compile (first pass)", "span reuse (pic)", "span reuse, recompute last span",
                          "span reuse, recompute in vLLM (default)", "span reuse, recompute in vLLM (kv_deviation)"]
    assert all(r["requests"] == 2 for r in rows.values())
    assert rows["full prefill (cold)"]["cached_share"] == 0 and rows["full prefill (cold)"]["top1_agreement"] == 1.0
    # A's own prefix cache and the stored spans: most of every prompt
    for name in ("local prefix hit (floor)", "span reuse (pic)"):
        assert rows[name]["cached_share"] > 0.5, rows[name]
    s = result["summary"]
    for key in ("local_hit_speedup", "pic_speedup_vs_prefix", "pic_top1_agreement"):
        assert s[key] is not None and s[key] > 0, key
    assert 0 <= s["pic_top1_agreement"] <= 1
    # the rows left out are named in the config and their keys kept, null
    assert result["config"]["store_rows"] is False
    assert s["restart_speedup"] is None and s["shared_tier_speedup"] is None and s["restart_load_ms_p50"] is None
    # a difference of latencies: its sign is not asserted
    assert len(s["saving_vs_prefix_pairs"]) == 2 and s["saving_vs_prefix"] > 0
    # saves wait for turns (the server idle, or a share of the time), but they all arrive: nothing dropped
    assert s["saved_share_before_restart"] == 1.0 and s["span_saved_share"] == 1.0
    # the recompute rows: spans loaded and repaired in vLLM's worker, each repair counted, none failed;
    # teacher-forced fidelity for them and the exact rows (full prefill against itself agrees fully)
    for name in ("span reuse, recompute in vLLM (default)", "span reuse, recompute in vLLM (kv_deviation)"):
        assert rows[name]["cached_share"] > 0.5, rows[name]
        assert 0 <= rows[name]["tf_agreement"] <= 1 and rows[name]["answer_kl_p50"] >= 0
    # (the cold row against its own pass: KL 0; its argmax can still differ from the greedy decode at a
    # bf16 near-tie, 1 in ~100 answer tokens measured, so its agreement is the floor, not 1 by construction)
    assert rows["full prefill (cold)"]["answer_kl_p90"] == 0 and rows["full prefill (cold)"]["tf_agreement"] > 0.5
    assert s["repairs"] >= 2 * 2 and s["repair_failures"] == 0 and s["repair_ms_mean"] > 0
    assert s["recompute_share"] > 0 and s["kv_deviation_share"] > 0 and s["repair_weights_mb"] > 100
    for key in ("recompute_speedup_vs_prefix", "recompute_top1_agreement", "recompute_kl_p50", "recompute_tf_agreement",
                "floor_tf_agreement", "repair_rss_mb"):
        assert s[key] is not None, key
