"""The bench harness end to end on a small configuration: table, JSON shape, plot."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # each test runs `contextkit bench` in a subprocess on a real model


def test_bench_engine_writes_json_and_plot(tmp_path, smol_dir, cli):
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    proc = cli("bench", "engine", "--n", "2", "--json", str(out), "--plot", str(png),
               "--set", "lengths=64,128", "--set", "decode_tokens=2", "--set", "eager=0",
               "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["bench"] == "engine"
    assert set(result) == {"bench", "config", "rows", "summary"}
    s = result["summary"]
    assert s["dtype"] == "float32"
    assert s["prefill_ratio_vs_transformers"] > 0 and s["decode_ratio_vs_transformers"] > 0
    assert 0 <= s["bf16_kl_vs_fp32_p50"] < 1.0
    rows = result["rows"]
    assert {(r["impl"], r["dtype"], r["tokens"]) for r in rows} >= {("engine", "float32", 128),
                                                                    ("transformers", "bfloat16", 64)}
    assert sum(r["default"] for r in rows) == 1
    assert all(r["prefill_ms_p50"] > 0 for r in rows)
    assert png.stat().st_size > 1000
    assert "prefill_ms_p50" in proc.stdout  # the table


def test_bench_rejects_unknown_name_and_bad_data(tmp_path, cli):
    proc = cli("bench", "nope")
    assert proc.returncode == 2 and "unknown bench" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    proc = cli("bench", "engine", "--data", str(bad), "--n", "1", "--set", "lengths=32")
    assert proc.returncode == 2 and "passages" in proc.stderr


def test_bench_spans_small_run(tmp_path, smol_dir, cli, vllm_url):
    """What CI runs of bench spans (DEVELOPERS.md, "What CI runs of each bench"): one question, the 1.5k band,
    the methods its summary and these checks use (both full prefills, the default, reuse, the budgets, the
    query_attention ratios, the attention budget), the vLLM rows on the shared server. The long bands run the
    same code on longer prompts (their padding: tests/bench/test_data.py; their shorter table:
    test_spans_methods.py)."""
    from contextkit.bench.data import SHARED_MULTIHOP

    bands = ("1.5k",)
    if not SHARED_MULTIHOP.is_file():
        # the 3k band pads a question with other questions' passages: the bundled example alone (a clone
        # without the shared data) is one question and gets a clear error for it
        proc = cli("bench", "spans", "--n", "1", "--set", "bands=3k", "--set", "split=all", "--set", "vllm=0")
        assert proc.returncode == 2 and "no question renders to the 3k band" in proc.stderr
    out = tmp_path / "spans.json"
    proc = cli("bench", "spans", "--n", "1", "--json", str(out), "--plot", str(tmp_path / "s.png"),
               "--set", "decode_tokens=4", "--set", "min_tokens=100", "--set", "max_tokens=2100",
               "--set", f"bands={','.join(bands)}", "--set", "split=all", "--upstream", vllm_url,
               "--set", "methods=budget,query_attention,attention_budget", timeout=1200)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    s = result["summary"]
    for key in ("default_method", "speedup_vs_full", "kl_p50", "top1_agreement", "answer_f1_delta",
                "answer_agreement_f1", "max_speed_method", "max_speed_speedup", "max_speed_top1",
                "vllm_cold_ttft_ms_p50", "budget_kl_p90", "tf_agreement", "answer_kl_p90", "gold_logprob_delta",
                "tf_agreement_fp32", "speedup_vs_full_same_dtype", "budget_holds_min", "calibration_profile",
                "budget_holds_0.02", "budget_holds_0.1", "tf_agreement_tokens", "tf_agreement_tie",
                "default_flips"):
        assert key in s, key
    # a near-tie never counts against the tie-aware agreement: it is at least the plain one
    assert s["tf_agreement_tie"] >= s["tf_agreement"]
    assert 0 <= s["budget_holds_min"] <= 1
    assert result["config"]["reference_dtype"] == "float32"
    for band in bands:
        rows = {r["method"]: r for r in result["rows"] if r["band"] == band and r["source"] == "all"}
        assert rows["full"]["kl_p50"] == 0 and rows["full"]["top1_agreement"] == 1
        assert rows["full"]["answer_agreement_f1"] == 1
        # teacher forcing: the reference's own greedy answer is its argmax at every position, at zero KL
        assert rows["full"]["tf_agreement_fp32"] == 1 and rows["full"]["answer_kl_p90_fp32"] == 0
        assert rows["full"]["tf_agreement_tokens_fp32"] == rows["full"]["tf_agreement_tie_fp32"] == 1
        assert rows["full"]["gold_logprob_delta_fp32"] == 0
        assert sum(r["default"] for r in rows.values()) == 1
        budgets = [r for r in rows.values() if r["policy"] == "budget" and r["dtype"] == result["config"]["dtype"]]
        assert sorted(r["fidelity_budget"] for r in budgets) == [0.02, 0.05, 0.1]
        assert all(r["profile"] == s["calibration_profile"] for r in budgets)  # "none" on a fresh machine
        for r in rows.values():
            if r["policy"] == "vllm":
                assert r["ttft_ms_p50"] > 0
                continue
            for key in ("ttft_ms_p50", "ttft_ms_p90", "speedup_vs_full", "kl_p50", "kl_p90", "top1_agreement",
                        "answer_agreement_f1", "greedy_match_32", "answer_f1", "answer_em", "tf_agreement",
                        "answer_kl_p50", "answer_kl_p90", "gold_logprob_delta", "tf_agreement_fp32"):
                assert key in r, (r["method"], key)
        # what makes reuse faster, and holds on any machine: "reuse" takes the whole context from compiled
        # spans and recomputes none of it ("full" prefills it), and a higher recompute ratio recomputes more
        assert rows["reuse"]["context_tokens_p50"] == rows["full"]["context_tokens_p50"] > 0
        assert rows["reuse"]["recomputed_tokens_p50"] == 0
        if band == "1.5k":
            assert 0 < rows["query_attention r=0.1"]["recomputed_tokens_p50"] \
                < rows["query_attention r=0.5"]["recomputed_tokens_p50"]
        assert {"vllm cold prefill", "vllm prefix cache (new order)"} <= set(rows)
    proc = cli("bench", "spans", "--n", "1", "--set", "min_tokens=90000", "--set", "bands=1.5k")
    assert proc.returncode == 2 and "min_tokens" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("bench", "spans", "--n", "1", "--set", "bands=9k")
    assert proc.returncode == 2 and "bands" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_rope_small_run(tmp_path, smol_dir, cli):
    out = tmp_path / "rope.json"
    proc = cli("bench", "rope", "--n", "1", "--json", str(out), "--set", "tokens=256", "--set", "reps=3",
               "--set", "dtypes=float32")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(out.read_text())["summary"]
    assert s["rerotate_vs_copy"] > 0 and 0 < s["rerotate_fraction_of_prefill"] < 1


def test_bench_skills_small_run(tmp_path, smol_dir, shared_data, cli):
    if not (shared_data / "skills" / "skills_index.jsonl").is_file():
        pytest.skip("the shared skills folder is not on this machine")
    out = tmp_path / "skills.json"
    proc = cli("bench", "skills", "--n", "2", "--json", str(out), "--set", "pairs=1", "--set", "decode_tokens=4",
               "--set", "min_tokens=300", "--set", "max_tokens=400")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    s = result["summary"]
    for key in ("speedup_vs_full", "top1_agreement", "kl_p50", "answer_agreement_f1", "erratum_agreement",
                "stale_agreement", "overwrite_agreement", "erratum_agreement_by_edits", "field_attention_share_p50"):
        assert key in s, key
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["full"]["kl_p50"] == 0 and rows["full"]["top1_agreement"] == 1 and rows["full"]["tasks"] == 3
    assert rows["full"]["tf_agreement"] == 1 and rows["full"]["answer_kl_p90"] == 0
    assert 0 <= s["splice_tf_agreement"] <= 1 and s["splice_answer_kl_p90"] >= 0
    assert sum(r["default"] for r in result["rows"]) == 2  # the default policy and the default edit path
    # every erratum task is decided (a forced choice) and counted once per edit path
    tasks = s["erratum_tasks"]
    assert tasks and all(isinstance(t["erratum"], bool) and 0 < t["edit_share"] < 1 for t in tasks)
    assert rows["erratum: erratum, 1 edit(s)"]["tasks"] == sum(t["edits"] == 1 for t in tasks)
    assert 0 <= s["field_attention_share_p50"] < 1
    proc = cli("bench", "skills", "--set", "min_tokens=90000", "--set", f"skills={tmp_path}")
    assert proc.returncode == 2 and "SKILL.md" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_synthesis_small_run(tmp_path, smol_dir, cli):
    out = tmp_path / "synthesis.json"
    proc = cli("bench", "synthesis", "--n", "1", "--json", str(out), "--set", "note_tokens=8",
               "--set", "answer_tokens=4")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    for key in ("ttft_speedup_vs_text", "answer_f1_delta", "answer_agreement_f1", "transcripts_ttft_speedup_vs_text",
                "tf_agreement", "answer_kl_p90", "gold_logprob_delta", "transcripts_tf_agreement"):
        assert key in result["summary"], key
    rows = {(r["path"], r["read"], r["method"]): r for r in result["rows"]}
    for read in ("notes", "transcripts"):
        text = rows[("local", read, "text")]
        assert text["answer_agreement_f1"] == 1.0 and text["top1_agreement"] == 1.0
        assert text["tf_agreement"] == 1.0 and text["gold_logprob_delta"] == 0
        reuse = rows[("local", read, "kv reuse")]
        assert 0 <= reuse["tf_agreement"] <= 1 and reuse["answer_kl_p90"] >= 0
    # a transcript holds the worker's passages and its note: a longer context than the note alone
    for path in ("local", "http"):
        assert rows[(path, "transcripts", "text")]["context_tokens_p50"] > rows[(path, "notes", "text")][
            "context_tokens_p50"]
        assert sum(r["default"] for r in result["rows"] if r["path"] == path) == 1
    # over HTTP to serve: the workers kept their answers, the joins named them, each arm against its own
    # text re-prefill (the same prompt: the text arm against itself agrees fully)
    s = result["summary"]
    for key in ("http_join_speedup_vs_text", "http_join_tf_agreement", "http_transcripts_join_tf_agreement",
                "http_kv_share", "http_keep_overhead_vs_worker_ttft"):
        assert s[key] is not None, key
    assert rows[("http", "notes", "text")]["tf_agreement"] == 1.0
    assert 0 <= s["http_join_tf_agreement"] <= 1 and 0 < s["http_kv_share"] <= 1
    proc = cli("bench", "synthesis", "--n", "1", "--set", "read=everything")
    assert proc.returncode == 2 and "read=" in proc.stderr and "Traceback" not in proc.stderr


def test_bench_agent_small_run(tmp_path, smol_dir, shared_data, cli):
    traces = shared_data / "traces" / "swe_agent_traces.jsonl"
    if not traces.is_file():
        pytest.skip("the shared agent traces are not on this machine")
    out = tmp_path / "agent.json"
    proc = cli("bench", "agent", "--n", "2", "--set", "max_tokens=1600", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    s = result["summary"]
    for key in ("speedup_vs_full", "kl_p50", "top1_agreement", "reused_share", "repeated_tool_outputs"):
        assert key in s, key
    assert s["requests"] >= 2 and 0 < s["reused_share"] < 1  # later turns reuse the earlier ones
    assert s["kl_max"] < 0.05  # exact KV: only bf16 rounding between chunked and whole prefill
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "not a trajectory"}\n')
    proc = cli("bench", "agent", "--data", str(bad))
    assert proc.returncode == 2 and "trajectory" in proc.stderr and "Traceback" not in proc.stderr
