"""The bench harness end to end on a small configuration: table, JSON shape, plot."""

from __future__ import annotations

import json

from test_cli import cli


def test_bench_engine_writes_json_and_plot(tmp_path, smol_dir):
    out, png = tmp_path / "engine.json", tmp_path / "engine.png"
    proc = cli("bench", "engine", "--n", "2", "--json", str(out), "--plot", str(png),
               "--set", "lengths=64,128", "--set", "decode_tokens=2", "--set", "eager=0")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["bench"] == "engine"
    assert set(result) == {"bench", "config", "rows", "summary"}
    s = result["summary"]
    assert s["dtype"] == "float32"
    assert s["prefill_ratio_vs_transformers"] > 0 and s["decode_ratio_vs_transformers"] > 0
    assert 0 <= s["bf16_kl_vs_fp32_p50"] < 1.0
    rows = result["rows"]
    assert {(r["impl"], r["dtype"], r["tokens"]) for r in rows} >= {("engine", "float32", 128), ("transformers", "bfloat16", 64)}
    assert sum(r["default"] for r in rows) == 1
    assert all(r["prefill_ms_p50"] > 0 for r in rows)
    assert png.stat().st_size > 1000
    assert "prefill_ms_p50" in proc.stdout  # the table


def test_bench_rejects_unknown_name_and_bad_data(tmp_path):
    proc = cli("bench", "nope")
    assert proc.returncode == 2 and "unknown bench" in proc.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    proc = cli("bench", "engine", "--data", str(bad), "--n", "1", "--set", "lengths=32")
    assert proc.returncode == 2 and "passages" in proc.stderr
