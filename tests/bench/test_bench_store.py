"""``contextkit bench store`` end to end on small spans against the real services."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow


def test_bench_store_small_run(tmp_path, smol_dir, redis_url, lmcache_url, cli):
    out = tmp_path / "store.json"
    proc = cli("bench", "store", "--n", "3", "--json", str(out), "--set", "sizes=32,64",
               "--set", f"redis_url={redis_url}", "--set", f"lmcache_url={lmcache_url}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    tiers = {(r["tier"], r["tokens"]) for r in result["rows"]}
    assert tiers == {(t, n) for t in ("memory", "lmcache-cpu", "disk", "lm", "redis", "disk-aes", "redis-aes")
                     for n in (32, 64)}
    assert {r["tier"] for r in result["rows"] if r["encrypted"]} == {"disk-aes", "redis-aes"}
    s = result["summary"]
    for k in ("memory_get_vs_copy", "disk_get_vs_read", "remote_get_vs_redis", "fetch_vs_compile_max",
              "redis_aes_get_vs_plain", "disk_aes_get_vs_plain", "mac_ms", "encode_aes_ms", "decode_aes_ms"):
        assert s[k] > 0, k
    proc = cli("bench", "store", "--n", "1", "--set", "tiers=memory,floppy")
    assert proc.returncode == 2 and "unknown tiers" in proc.stderr
