"""Entry bytes and checks; the memory tier's budget, cost-aware eviction, stats and Prometheus text."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from contextkit.core.errors import ConfigError, CorruptEntryError
from contextkit.kvstore.entry import decode, encode_bytes
from contextkit.kvstore.memory import MemoryTier
from contextkit.kvstore.metrics import StoreCollector
from contextkit.kvstore.tiered import TieredStore


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype, mac, key, entry, same):
    k = key("a")
    e = entry(k, 33, dtype)
    back = decode(encode_bytes(e, mac), k, mac)
    assert same(back, e) and back.meta == e.meta


def test_every_damage_is_refused(mac, key, entry):
    k = key("a")
    data = encode_bytes(entry(k, 16), mac)
    flipped = bytearray(data)
    flipped[-5] ^= 0x10
    cases = {
        "truncated": data[:-1], "extended": data + b"\x00", "flipped bit": bytes(flipped),
        "bad magic": b"X" + data[1:], "header cut": data[:20], "empty": b"",
    }  # fmt: skip
    for name, bad in cases.items():
        with pytest.raises(CorruptEntryError):
            decode(bad, k, mac)
        assert decode(data, k, mac).meta.digest == k.digest, name  # the good bytes still decode: only damage fails
    with pytest.raises(CorruptEntryError, match="another key"):
        decode(data, key("b"), mac)
    with pytest.raises(CorruptEntryError, match="another key"):
        decode(data, key("a", tenant="other-tenant").__class__(k.digest, "other-tenant"), mac)


def test_memory_tier_budget_and_lru_at_equal_cost(key, entry):
    e0 = entry(key(0), 16)
    tier = MemoryTier(max_bytes=e0.nbytes * 3)
    for i in range(3):
        tier.put(key(i), entry(key(i), 16))
    assert "get_ms_p50" not in tier.stats()  # puts are not get latencies
    assert tier.get(key(0)) is not None  # 0 is now the most recently used
    tier.put(key(3), entry(key(3), 16))
    assert tier.contains(key(0)) and not tier.contains(key(1))  # LRU went
    s = tier.stats()
    assert s["bytes"] <= tier.max_bytes and s["entries"] == 3 and s["evictions"] == 1
    # the one served get: counted, its bytes counted, its latency sampled (none was before it)
    assert s["hits"] == 1 and s["get_bytes"] == e0.nbytes and "get_ms_p50" in s


def test_memory_tier_keeps_what_is_expensive_to_recompute(key, entry):
    cheap = entry(key("cheap"), 16, cost_ms=1.0)
    tier = MemoryTier(max_bytes=cheap.nbytes * 2)
    tier.put(key("costly"), entry(key("costly"), 16, cost_ms=500.0))
    tier.put(key("cheap"), cheap)  # more recent, but 500x cheaper to recompute
    tier.put(key("new"), entry(key("new"), 16, cost_ms=5.0))
    assert tier.contains(key("costly")) and not tier.contains(key("cheap"))
    # ...and old entries still age out: once others have been evicted, inflation catches up
    for i in range(200):
        tier.put(key(f"x{i}"), entry(key(f"x{i}"), 16, cost_ms=50.0))
    assert not tier.contains(key("costly"))


def test_memory_tier_get_returns_the_stored_tensors_and_bad_config_is_refused(key, entry):
    e = entry(key("z"), 8)
    tier = MemoryTier()
    tier.put(key("z"), e)
    assert tier.get(key("z")).tensors["k"].data_ptr() == e.tensors["k"].data_ptr()  # no copy
    assert tier.get(key("z", tenant="t2")) is None
    assert tier.delete(key("z")) and not tier.delete(key("z"))
    with pytest.raises(ValueError):
        tier.put(key("y"), e)  # an entry made for another key
    with pytest.raises(ConfigError):
        MemoryTier(0)


def test_prometheus_metrics(key, entry):
    tier = MemoryTier()
    tier.put(key(1), entry(key(1), 8))
    tier.get(key(1))
    tier.get(key(2))
    registry = CollectorRegistry()
    registry.register(StoreCollector(TieredStore([tier])))
    text = generate_latest(registry).decode()
    assert 'contextkit_kvstore_hits_total{tier="memory"} 1.0' in text
    assert 'contextkit_kvstore_misses_total{tier="memory"} 1.0' in text
    assert "# TYPE contextkit_kvstore_bytes gauge" in text
    assert registry.get_sample_value("contextkit_kvstore_bytes", {"tier": "memory"}) == tier.stats()["bytes"] > 0
    assert 'contextkit_kvstore_get_latency_ms_p50{tier="memory"}' in text
