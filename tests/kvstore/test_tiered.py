"""Tiers behind one face (promotion, write-through, stats) and the span cache on kvstore end to end:
a span compiled in one process is served from the disk tier in the next, and from Redis to another."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from contextkit.core.config import REMOTE_SCHEMES, KVStoreConfig
from contextkit.core.errors import ConfigError
from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
from contextkit.kvstore.memory import MemoryTier
from contextkit.kvstore.metrics import StoreCollector
from contextkit.kvstore.tiered import TieredStore, build_store

pytestmark = pytest.mark.slow


def test_promotion_on_hit_and_write_through(tmp_path, mac, key, entry, same):
    disk = LMCacheTier(LMCacheTierConfig("disk", disk_dir=tmp_path, mac_key=mac))
    mem = MemoryTier()
    with TieredStore([mem, disk]) as store:
        k, e = key("a"), entry(key("a"), 32)
        store.put(k, e)  # write-through: both tiers
        assert mem.contains(k) and disk.wait_visible(k)
        mem.delete(k)
        assert same(store.get(k), e)  # from disk...
        assert mem.contains(k)  # ...and promoted
        stats = store.stats()
        assert stats["memory"]["puts"] == 2 and stats["disk"]["hits"] == 1
        assert any(m.samples and m.samples[0].labels == {"tier": "memory"} for m in StoreCollector(store).collect())
        assert {s.labels["tier"] for m in StoreCollector(store).collect() for s in m.samples} == {"memory", "disk"}
        assert store.delete(k) and not store.contains(k)


def test_build_store_and_bad_config(tmp_path, redis_url, mac):
    store = build_store(KVStoreConfig(disk_dir=tmp_path, remote_url=redis_url), mac)
    try:
        assert [t.name for t in store.tiers] == ["memory", "disk", "redis"]
    finally:
        store.close()
    # the vLLM connector's tiers: no memory tier (vLLM's prefix cache is its memory), the step's deadline
    store = build_store(KVStoreConfig(disk_dir=tmp_path, remote_url=redis_url, remote_timeout_s=0.5), mac,
                        memory=False, disk_timeout_s=0.5)
    try:
        assert [t.name for t in store.tiers] == ["disk", "redis"]
        assert all(t.cfg.timeout_s == 0.5 for t in store.tiers)
    finally:
        store.close()
    with pytest.raises(ConfigError, match="lm://host:port .* or redis://host:port"):
        KVStoreConfig(remote_url="http://localhost:1")
    with pytest.raises(ConfigError):
        KVStoreConfig(memory_bytes=0)
    with pytest.raises(ConfigError):
        TieredStore([MemoryTier(), MemoryTier()])


SPAN_CHILD = """
import sys, json, torch
from pathlib import Path
from contextkit.core.config import KVStoreConfig
from contextkit.engine import Engine
from contextkit.kvstore.tiered import build_store
from contextkit.spans.assemble import SpanCache
from contextkit.spans.store import KVSpanStore
from contextkit.core.types import Span
disk, remote = sys.argv[2] or None, sys.argv[3] or None
store = KVSpanStore(build_store(KVStoreConfig(disk_dir=disk, remote_url=remote), bytes(range(32))))
cache = SpanCache(Engine.from_dir(Path(sys.argv[1])), store=store, tokenizer_fingerprint="t")
span = Span(tuple(range(1000, 1200)))
compiled, hit = cache.compiled(span, tenant="acme")
for t in store.kv.tiers[1:]:
    assert t.wait_visible(compiled.key)
print(json.dumps({"hit": hit, "k": compiled.k.float().sum().item(), "stats": store.stats}))
store.kv.close()
"""


def _span_run(smol_dir: Path, disk: Path | str = "", remote: str = "") -> dict:
    import json

    proc = subprocess.run([sys.executable, "-c", SPAN_CHILD, str(smol_dir), str(disk), remote],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_span_cache_serves_spans_across_restarts_and_processes(tmp_path, smol_dir, redis_url):
    first = _span_run(smol_dir, disk=tmp_path / "kv")
    assert not first["hit"]
    again = _span_run(smol_dir, disk=tmp_path / "kv")  # a new process: memory empty, disk tier hit
    assert again["hit"] and again["k"] == first["k"]
    shared = _span_run(smol_dir, remote=redis_url)  # Redis, shared by processes
    other = _span_run(smol_dir, remote=redis_url)
    assert other["hit"] and other["k"] == shared["k"] == first["k"]


@pytest.mark.parametrize("url", ["http://localhost:1", "redis://localhost", "lm://:7000", "redis://host:port",
                                 "redis:localhost:6379"])
def test_every_setting_that_takes_a_remote_tier_checks_the_one_list(url, tmp_path):
    # serve's kvstore, the vLLM connector's settings and the LMCache tier refuse the same URLs with one message
    from contextkit.integrations.vllm_connector import ConnectorSettings

    messages = []
    for make in (lambda: KVStoreConfig(remote_url=url), lambda: ConnectorSettings(remote_url=url),
                 lambda: LMCacheTierConfig("remote", remote_url=url, mac_key=bytes(32))):
        with pytest.raises(ConfigError) as info:
            make()
        messages.append(str(info.value).split(" must be ")[1])
    assert len(set(messages)) == 1 and repr(url) in messages[0]
    for scheme in REMOTE_SCHEMES:
        assert ConnectorSettings(remote_url=f"{scheme}://127.0.0.1:1").store().remote_url == f"{scheme}://127.0.0.1:1"


def test_the_connector_describes_its_tiers_as_serve_does(tmp_path):
    # vLLM's connector builds its tiers from a KVStoreConfig too: every tier setting it has reaches it, by name
    from contextkit.integrations.vllm_connector import ConnectorSettings

    settings = ConnectorSettings(disk_dir=tmp_path, disk_bytes=3 << 30, remote_url="redis://127.0.0.1:1",
                                 timeout_s=0.7, encrypt=True)
    store = settings.store()
    assert (store.disk_dir, store.disk_bytes, store.remote_url, store.remote_timeout_s, store.encrypt) == (
        tmp_path, 3 << 30, "redis://127.0.0.1:1", 0.7, True)
    shared = set(KVStoreConfig.__dataclass_fields__) & set(ConnectorSettings.__dataclass_fields__)
    assert shared == {"disk_dir", "disk_bytes", "remote_url", "encrypt"}  # memory_bytes: vLLM's prefix cache
