"""Tiers behind one face: memory, then disk, then remote.

Reads go down the tiers and promote a hit into every faster tier. Writes go through to every tier
(write-through: the memory tier synchronously, LMCache's disk and remote backends asynchronously, not
waited on). Write-through rather than write-back because the point of the disk and remote tiers is that
another process, or this one after a restart, finds the span: an entry that only reaches them on
eviction would be missing exactly when a second process asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from contextkit.core.config import KVStoreConfig
from contextkit.core.errors import ConfigError
from contextkit.kvstore.base import KVStore, StoreKey
from contextkit.kvstore.entry import Entry
from contextkit.kvstore.memory import MemoryTier


class TieredStore:
    name = "tiered"

    def __init__(self, tiers: Sequence[KVStore]):
        if not tiers:
            raise ConfigError("a tiered store needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be distinct, got {names}")
        self.tiers = list(tiers)

    def contains(self, key: StoreKey) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def get(self, key: StoreKey) -> Entry | None:
        for i, tier in enumerate(self.tiers):
            entry = tier.get(key)
            if entry is not None:
                if i:
                    kept = entry.owned()  # a borrowed LMCache buffer must not live on in memory
                    for faster in self.tiers[:i]:
                        faster.put(key, kept)
                    return kept
                return entry
        return None

    def put(self, key: StoreKey, entry: Entry) -> None:
        for tier in self.tiers:
            tier.put(key, entry)

    def delete(self, key: StoreKey) -> bool:
        return any([t.delete(key) for t in self.tiers])

    def stats(self) -> dict[str, dict]:
        return {t.name: t.stats() for t in self.tiers}

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_store(cfg: KVStoreConfig, mac_key: bytes, enc_key: bytes | None = None) -> TieredStore:
    """The tiers ``cfg`` asks for: memory always; LMCache disk if ``disk_dir``; LMCache remote if ``remote_url``.
    ``mac_key`` authenticates every entry the disk and remote tiers hold; ``enc_key`` (required when
    ``cfg.encrypt``) encrypts them."""
    if cfg.encrypt and enc_key is None:
        raise ConfigError("kvstore encrypt is set: build_store needs enc_key (derive(secret, 'kv-enc'))")
    enc_key = enc_key if cfg.encrypt else None
    tiers: list = [MemoryTier(cfg.memory_bytes)]
    if cfg.disk_dir is not None or cfg.remote_url:
        from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig

        if cfg.disk_dir is not None:
            tiers.append(LMCacheTier(LMCacheTierConfig("disk", max_bytes=cfg.disk_bytes, disk_dir=cfg.disk_dir,
                                                         mac_key=mac_key, enc_key=enc_key)))
        if cfg.remote_url:
            tiers.append(LMCacheTier(LMCacheTierConfig("remote", remote_url=cfg.remote_url,
                                                       timeout_s=cfg.remote_timeout_s, mac_key=mac_key,
                                                       enc_key=enc_key)))
    return TieredStore(tiers)
