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
from contextkit.kvstore.deadline import Deadline
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

    def contains_many(self, keys: Sequence[StoreKey], *, deadline: Deadline) -> list[bool]:
        """Which of ``keys`` some tier holds: one batched call per tier for the keys still unknown, all
        within ``deadline`` (a tier without batched calls is asked key by key: a local one)."""
        found = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, hit in enumerate(found) if not hit]
            if not todo or deadline.expired:
                break
            batch = getattr(tier, "contains_many", None)
            hits = (batch([keys[i] for i in todo], deadline=deadline) if batch is not None
                    else [tier.contains(keys[i]) for i in todo])
            for i, hit in zip(todo, hits):
                found[i] = hit
        return found

    def get_many(self, keys: Sequence[StoreKey], *, deadline: Deadline) -> list[Entry | None]:
        """``get`` of every key, one batched call per tier within ``deadline``; hits in a slower tier are
        promoted into the faster ones, as ``get`` does."""
        out: list[Entry | None] = [None] * len(keys)
        for t, tier in enumerate(self.tiers):
            todo = [i for i, e in enumerate(out) if e is None]
            if not todo or deadline.expired:
                break
            batch = getattr(tier, "get_many", None)
            got = (batch([keys[i] for i in todo], deadline=deadline) if batch is not None
                   else [tier.get(keys[i]) for i in todo])
            for i, entry in zip(todo, got):
                if entry is not None and t:
                    entry = entry.owned()  # a borrowed LMCache buffer must not live on in memory
                    for faster in self.tiers[:t]:
                        faster.put(keys[i], entry)
                out[i] = entry
        return out

    def put(self, key: StoreKey, entry: Entry) -> None:
        for tier in self.tiers:
            tier.put(key, entry)

    def put_many(self, items: Sequence[tuple[StoreKey, Entry]]) -> None:
        """``put`` of every item, one batched call per tier that has one; tiers that store the same
        encoding (LMCache's, under one deployment's keys) share it: each entry is encoded once."""
        encoded: dict = {}
        for tier in self.tiers:
            batch = getattr(tier, "put_many", None)
            if batch is not None:
                batch(items, encoded=encoded)
            else:
                for key, entry in items:
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


def build_store(cfg: KVStoreConfig, mac_key: bytes, enc_key: bytes | None = None, *, memory: bool = True,
                disk_timeout_s: float | None = None) -> TieredStore:
    """The tiers ``cfg`` asks for: memory (unless ``memory`` is False: vLLM's connector, whose memory tier is
    vLLM's own prefix cache); LMCache disk if ``disk_dir`` (its calls bounded by ``disk_timeout_s``; None:
    the tier's default); LMCache remote if ``remote_url``. ``mac_key`` authenticates every entry the disk
    and remote tiers hold; ``enc_key`` (required when ``cfg.encrypt``) encrypts them. Every process that
    keeps KV builds its tiers here (serve's kit and the vLLM connector): a tier added here reaches both."""
    if cfg.encrypt and enc_key is None:
        raise ConfigError("kvstore encrypt is set: build_store needs enc_key (derive(secret, 'kv-enc'))")
    enc_key = enc_key if cfg.encrypt else None
    tiers: list = [MemoryTier(cfg.memory_bytes)] if memory else []
    if cfg.disk_dir is not None or cfg.remote_url:
        from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig

        if cfg.disk_dir is not None:
            timeout = {} if disk_timeout_s is None else {"timeout_s": disk_timeout_s}
            tiers.append(LMCacheTier(LMCacheTierConfig("disk", max_bytes=cfg.disk_bytes, disk_dir=cfg.disk_dir,
                                                         mac_key=mac_key, enc_key=enc_key, **timeout)))
        if cfg.remote_url:
            tiers.append(LMCacheTier(LMCacheTierConfig("remote", remote_url=cfg.remote_url,
                                                       timeout_s=cfg.remote_timeout_s, mac_key=mac_key,
                                                       enc_key=enc_key)))
    return TieredStore(tiers)
