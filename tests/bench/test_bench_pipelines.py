"""``contextkit bench pipelines`` end to end on a tiny trace against the real vLLM server."""

from __future__ import annotations

import json

import pytest

from contextkit.bench.workload import write_trace

pytestmark = pytest.mark.slow


def test_bench_pipelines_small_run(tmp_path, vllm_url, cli, trace_requests):
    trace, out = tmp_path / "trace.jsonl", tmp_path / "pipelines.json"
    # per item: its passages, then the same set in another order; CI runs the first item's two requests
    # (DEVELOPERS.md, "What CI runs of each bench")
    write_trace(trace_requests(1), trace)
    proc = cli("bench", "pipelines", "--upstream", vllm_url, "--trace", str(trace), "--n", "2", "--json", str(out),
               "--set", "max_tokens=3", "--set", "answer_tokens=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["pipeline"]: r for r in result["rows"]}
    assert set(rows) == {"langchain without", "langchain with", "langchain with (retrieval order)",
                         "llamaindex without", "llamaindex with",
                         "kv without (full prefill)", "kv with (span reuse)", "sdk session (proxy)"}
    assert all(r["requests"] == 2 for r in rows.values())
    for base in ("langchain without", "llamaindex without", "kv without (full prefill)"):
        assert rows[base]["answer_agreement_f1"] == 1.0  # each baseline against itself
    # the two adapters send the same request through the one planner: the same prompt length
    assert rows["langchain with"]["prompt_tokens_p50"] == rows["llamaindex with"]["prompt_tokens_p50"]
    # the trace repeats each passage set in another order: the proxy reorders it into vLLM's cache
    assert rows["langchain with"]["cached_share"] > 0 and rows["kv with (span reuse)"]["cached_share"] > 0
    assert rows["kv without (full prefill)"]["cached_share"] == 0
    # the KV path's fidelity over the whole answer (teacher-forced against full prefill of the same plan)
    kv = rows["kv with (span reuse)"]
    assert kv["fidelity_prompt_mismatches"] == 0  # it scored the prompts the pipeline served
    assert 0.5 < kv["tf_agreement"] <= 1 and 0 <= kv["answer_kl_p50"] <= kv["answer_kl_p90"]
    assert kv["gold_logprob_delta"] is not None  # the trace's questions carry gold answers
    assert "tf_agreement" not in rows["kv without (full prefill)"]
    s = result["summary"]
    for key in ("langchain_ttft_reduction", "llamaindex_ttft_reduction", "kv_path_ttft_reduction",
                "answer_f1_delta", "answer_agreement_f1", "adapter_overhead_ms_p50", "kv_path_tf_agreement",
                "kv_path_answer_kl_p90", "kv_path_gold_logprob_delta"):
        assert key in s and s[key] is not None, key
    assert 0 < s["adapter_overhead_ms_p50"] and 0 <= s["answer_agreement_f1"] <= 1
    assert 0 < s["session_documents_sent_share"] <= 1
    lo, hi = s["answer_f1_delta_ci95"]
    assert lo <= hi
