"""LMCache (0.5.6) underneath kvstore: one adapter, one tier per LMCache backend.

Each ``LMCacheTier`` owns one LMCache ``StorageManager`` with one backend active: ``cpu``
(LocalCPUBackend), ``disk`` (LocalDiskBackend) or ``remote`` (RemoteBackend: ``lm://host:port`` for
``lmcache_server``, ``redis://host:port`` for Redis). An entry travels as its encoded bytes
(``kvstore.entry``: header with key digest, tenant, shapes, checksum; then the tensors) in a 1-D
uint8 ``MemoryObj``; LMCache moves and keeps the bytes, we check them on the way out.

Our config maps onto LMCache's keys in ``lmcache_config`` (and only there). LMCache's sharp edges on a
CPU machine, each worked around here and tested (tests/kvstore):
- Chunk hashes: without vLLM LMCache hashes tokens with Python ``hash()`` (salted per process). We never
  let it hash: the key's ``chunk_hash`` is the first 64 bits of its keyed name (``StoreNames``, from the
  deployment's secret: the same in every process sharing it, and nothing a reader of Redis or the disk can
  compute from a guessed document); the full name is in the entry header and checked on every read, so a
  64-bit collision (or another key's entry under the same hash) is a miss, never a wrong KV.
- LocalDiskBackend keeps its index in memory only and does not reload its files after a restart; it
  also writes files in place (a crash leaves a truncated file). We scan the directory at start and
  register every file with ``insert_key``, register files another process wrote on a miss, write
  through a temp file + ``os.replace`` (atomic: two writers of one key leave one whole file), and a
  file that fails its checks on read is removed and counted.
- ``RedisConnector.close`` deadlocks (it waits on its own event loop for a sync shutdown); we replace it
  with the async shutdown under a timeout. Redis URLs get a socket timeout below the blocking timeout,
  because each timed-out get otherwise kills one of the connector's four workers for good.
- A killed or stalled remote makes LMCache return ``None`` (or, for a stalled ``lm://``, hang
  ``contains``). Every remote call runs under a deadline; a failure marks the tier down, later calls
  answer a miss at once, and after ``retry_after_s`` a TCP probe decides whether to recreate the backend.
- ``StorageManager.get`` copies disk/remote hits into the CPU pool where they can never be evicted
  (hangs after a few gets); we use ``batched_get(location=...)`` only. A hit is a buffer of LMCache's
  pool (for the CPU backend, the cached buffer itself): the entry borrows it without a copy and hands
  it back when its last tensor is freed; ``Entry.owned()`` copies for anyone who keeps it.
- LMCache's metrics logger sets ``PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus`` when it is unset: one
  fixed directory for every process on the host, never wiped. Inside a vLLM server (the KV connector)
  vLLM's ``/metrics`` then reads it and sums the counters of every earlier server (seen: a restarted
  server reporting the previous one's external cache hits). A tier sets a fresh directory of its own
  first, removed at exit; one you set wins.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from contextkit.core.config import check_remote_url
from contextkit.core.errors import ConfigError, CorruptEntryError
from contextkit.kvstore.base import StoreKey, TierStats
from contextkit.kvstore.deadline import Deadline
from contextkit.kvstore.entry import ENC_KEY_BYTES, MAC_BYTES, Entry, decode, encode
from contextkit.kvstore.lmcache_backend import (
    BACKEND,
    atomic_disk_writes,
    chunk_hash,
    engine_key,
    lmcache_config,
    patch_redis_close,
    private_prometheus_dir,
    register_disk_file,
    reload_disk_dir,
    tenant_tag,
)
from contextkit.kvstore.lmcache_remote import RemoteHealth

# LMCache's side (config mapping, keys, patches) lives in lmcache_backend, a remote tier's health in
# lmcache_remote; the names below stay importable from here, where they always were.
__all__ = ["LMCacheTier", "LMCacheTierConfig", "chunk_hash", "lmcache_config", "tenant_tag"]


@dataclass(frozen=True, slots=True)
class LMCacheTierConfig:
    kind: str  # cpu | disk | remote
    max_bytes: int = 4 << 30  # capacity of this tier (cpu, disk); the remote server has its own
    disk_dir: Path | None = None
    remote_url: str | None = None  # lm://host:port or redis://host:port
    pool_bytes: int = 512 << 20  # LMCache's CPU pool: staging for disk/remote, the store for cpu
    timeout_s: float = 5.0  # deadline of one remote call
    retry_after_s: float = 2.0  # after a remote failure, how long to answer misses before probing again
    # keys the MAC of every entry (kvstore.entry); processes sharing a tier share it (derive(secret, "kv-mac"))
    mac_key: bytes = field(default=b"", repr=False)
    # encrypts every entry's payload at rest (AES-256-GCM; derive(secret, "kv-enc")); None: plain
    enc_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in BACKEND:
            raise ConfigError(f"LMCache tier kind must be cpu, disk or remote, got {self.kind!r}")
        if self.kind == "disk" and self.disk_dir is None:
            raise ConfigError("a disk tier needs disk_dir (a directory it may own)")
        if self.kind == "remote":
            check_remote_url(self.remote_url or "")
        if len(self.mac_key) != MAC_BYTES:
            raise ConfigError(f"an LMCache tier needs mac_key ({MAC_BYTES} bytes, "
                              "contextkit.core.tenancy.derive(secret, 'kv-mac')): entries that leave the process "
                              "are authenticated")
        if self.enc_key is not None and len(self.enc_key) != ENC_KEY_BYTES:
            raise ConfigError(f"enc_key must be {ENC_KEY_BYTES} bytes "
                              "(contextkit.core.tenancy.derive(secret, 'kv-enc'))")
        if self.max_bytes <= 0 or self.pool_bytes <= 0 or self.timeout_s <= 0:
            raise ConfigError("max_bytes, pool_bytes and timeout_s must be positive")

class LMCacheTier(RemoteHealth):
    """A kvstore tier on one LMCache backend. Thread-safe (LMCache's calls block; its loop is its own)."""

    def __init__(self, cfg: LMCacheTierConfig, name: str | None = None):
        # LMCache logs every tier start and every swallowed remote error at INFO/WARNING; our counters
        # (stats(): errors, corrupt, down) carry those events. LMCACHE_LOG_LEVEL set by you wins.
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        private_prometheus_dir()
        try:
            import torch
            from lmcache.v1.event_manager import EventManager
            from lmcache.v1.metadata import LMCacheMetadata
            from lmcache.v1.storage_backend.storage_manager import StorageManager
        except ImportError as exc:
            raise ConfigError("the LMCache tiers need lmcache: pip install 'contextkit[lmcache]'") from exc
        self.cfg = cfg
        # the remote tier's URL scheme (a key of core.config.REMOTE_SCHEMES); LMCache's Redis connector has
        # batched lookups, deletes and a broken close that the other schemes do not
        self.scheme = urllib.parse.urlparse(cfg.remote_url).scheme if cfg.kind == "remote" else None
        self.name = name or (self.scheme or cfg.kind)
        self.backend = BACKEND[cfg.kind]
        self._stats = TierStats(self.name)
        self._torch = torch
        if self.scheme == "redis":
            patch_redis_close()
        if cfg.kind == "disk":
            Path(cfg.disk_dir).mkdir(parents=True, exist_ok=True)
        md = LMCacheMetadata(model_name="contextkit", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 1, 256, 1, 1), chunk_size=256)
        self._sm = StorageManager(lmcache_config(cfg), md, EventManager())
        self._init_health(self.name)
        if cfg.kind == "disk":
            atomic_disk_writes(self._disk())
            reload_disk_dir(self._disk(), Path(cfg.disk_dir))
            self._stats.entries = len(self._disk().dict)
        if cfg.kind == "remote" and not self._probe():
            self._down_until = time.monotonic() + cfg.retry_after_s

    # -- LMCache keys ------------------------------------------------------------------------------
    def _key(self, key: StoreKey):
        return engine_key(key, mac_key=self.cfg.mac_key)

    def _disk(self):
        return self._sm.storage_backends[self.backend]

    # -- the KVStore interface -----------------------------------------------------------------------
    def contains(self, key: StoreKey) -> bool:
        if not self._available():
            return False
        ck = self._key(key)
        try:
            hit = self._call(self._sm.contains, ck, [self.backend]) is not None
        except Exception:  # noqa: BLE001 - a failing tier answers a miss; counted
            self._failed()
            return False
        if not hit and self.cfg.kind == "disk":
            path = Path(self._disk()._key_to_path(ck))
            hit = path.is_file() and register_disk_file(self._disk(), path)  # written by another process
        return hit

    def get(self, key: StoreKey) -> Entry | None:
        t0 = time.perf_counter()
        if not self._available() or (self.cfg.kind == "disk" and not self.contains(key)):
            self._stats.add("misses")
            return None
        ck = self._key(key)
        try:
            obj = self._call(lambda: self._sm.batched_get([ck], location=self.backend)[0])
        except Exception:  # noqa: BLE001
            self._failed()
            obj = None
        if obj is None and self.cfg.kind == "remote" and not self._probe():  # a miss, or is the server gone?
            self._failed()
        return self._entry(key, obj, t0)

    def _entry(self, key: StoreKey, obj, t0: float) -> Entry | None:
        """The checked entry in LMCache's ``obj`` (None: a miss), counted."""
        if obj is None:
            self._stats.add("misses")
            return None
        # Zero copy: the entry's tensors view LMCache's buffer, and the buffer goes back to LMCache's
        # pool when the last tensor over it is freed (the finalizer hangs on the array every tensor
        # keeps alive). A copy is made only by whoever keeps the entry (TieredStore's promotion).
        arr = obj.tensor.reshape(-1).numpy()
        weakref.finalize(arr, obj.ref_count_down)
        try:
            entry = decode(memoryview(arr), key, self.cfg.mac_key, borrowed=True, enc_key=self.cfg.enc_key)
        except CorruptEntryError:
            self._stats.add("corrupt")
            self._stats.add("misses")
            self.delete(key)
            return None
        self._stats.hit(entry.nbytes, t0)
        return entry

    # -- batched calls under one deadline (issue #26: one call per key, each with its own deadline, held
    # vLLM's scheduler for keys x timeout when a store answered just under it) ------------------------
    def contains_many(self, keys: Sequence[StoreKey], *, deadline: Deadline) -> list[bool]:
        """Which of ``keys`` this tier holds, within what is left of ``deadline``; unknown by then is a miss.
        Redis: one round trip (a pipeline of EXISTS); lm://: one call for all keys (LMCache's server has
        no batched lookup); local tiers: no deadline needed."""
        if not keys:
            return []
        if self.cfg.kind != "remote":
            return [self.contains(k) for k in keys]
        if deadline.expired or not self._available():
            return [False] * len(keys)
        cks = [self._key(k) for k in keys]
        if self.scheme == "redis":
            fn = lambda: self._redis_exists(cks)
        else:
            fn = lambda: [self._sm.contains(ck, [self.backend]) is not None for ck in cks]
        try:
            return list(self._call(fn, timeout_s=deadline.remaining()))
        except Exception:  # noqa: BLE001 - a failing or slow tier answers misses; counted
            self._failed()
            return [False] * len(keys)

    def get_many(self, keys: Sequence[StoreKey], *, deadline: Deadline) -> list[Entry | None]:
        """The entries of ``keys`` (None: a miss), fetched together within what is left of ``deadline``
        (LMCache's remote backend sends the gets of a batch concurrently)."""
        t0 = time.perf_counter()
        if self.cfg.kind != "remote":
            return self._get_local(keys, t0)
        if not keys or deadline.expired or not self._available():
            self._stats.add("misses", len(keys))
            return [None] * len(keys)
        cks = [self._key(k) for k in keys]

        def give_back(objs) -> None:  # the caller gave up: hand the buffers back to LMCache's pool
            for o in objs or ():
                if o is not None:
                    o.ref_count_down()

        try:
            objs = self._call(lambda: self._sm.batched_get(cks, location=self.backend),
                              timeout_s=deadline.remaining(), on_abandon=give_back)
        except Exception:  # noqa: BLE001
            self._failed()
            objs = []
        objs = list(objs) + [None] * (len(keys) - len(objs))  # LMCache stops its list at a failed get
        if all(o is None for o in objs) and not self._probe():
            self._failed()
        return [self._entry(k, o, t0) for k, o in zip(keys, objs)]

    def _get_local(self, keys: Sequence[StoreKey], t0: float) -> list[Entry | None]:
        """A local tier's entries in one LMCache call: its disk backend then reads the files concurrently
        (one call per key cost ~0.4 ms of Python each: 13 ms of a 1k-token restart load)."""
        want = [k for k in keys if self.cfg.kind != "disk" or self.contains(k)]
        objs: list = []
        if want:
            try:
                objs = list(self._call(self._sm.batched_get, [self._key(k) for k in want], self.backend))
            except Exception:  # noqa: BLE001 - a failing tier answers misses; counted
                self._failed()
        objs += [None] * (len(want) - len(objs))
        got = dict(zip(want, self._entries(want, objs, t0)))
        self._stats.add("misses", len(keys) - len(want))
        return [got.get(k) for k in keys]

    def _entries(self, keys: Sequence[StoreKey], objs: list, t0: float) -> list[Entry | None]:
        """``_entry`` of each, half of them on the tier's pool: checking an entry's MAC (BLAKE3) releases the
        GIL, and a load waits for all of them (measured: ~7 of the 13 ms a 1k-token load spent fetching)."""
        half = len(keys) // 2
        if half < 2:
            return [self._entry(k, o, t0) for k, o in zip(keys, objs)]
        first = self._pool.submit(lambda: [self._entry(k, o, t0) for k, o in zip(keys[:half], objs[:half])])
        rest = [self._entry(k, o, t0) for k, o in zip(keys[half:], objs[half:])]
        return first.result() + rest

    def put(self, key: StoreKey, entry: Entry) -> None:
        """Submit the entry (LMCache writes disk and remote asynchronously: write-through, not waited on)."""
        self.put_many([(key, entry)])

    def put_many(self, items: Sequence[tuple[StoreKey, Entry]], *, encoded: dict | None = None) -> None:
        """Submit the entries in one LMCache call. ``encoded`` is shared by the tiers of one store: an
        entry already encoded under the same keys by another tier is not encoded again."""
        t0 = time.perf_counter()
        if not items:
            return
        if not self._available():
            self._stats.add("errors", len(items))
            return
        encoded = {} if encoded is None else encoded
        keys, objs, size = [], [], 0
        for key, entry in items:
            entry.check_for(key)
            memo = (id(entry), self.cfg.mac_key, self.cfg.enc_key)
            if memo not in encoded:
                encoded[memo] = (entry, encode(entry, self.cfg.mac_key, self.cfg.enc_key))  # entry: keeps id valid
            obj = self._copy_in(encoded[memo][1])
            if obj is None:  # LMCache's pool is full (or the entry is larger than it): not stored, counted
                self._stats.add("errors")
                continue
            keys.append(self._key(key))
            objs.append(obj)
            size += obj.tensor.numel()
        if not objs:
            return
        try:
            self._call(self._sm.batched_put, keys, objs)
        except Exception:  # noqa: BLE001
            self._failed()
            return
        self._stats.add("puts", len(objs))
        self._stats.add("put_bytes", size)
        self._stats.time("put", t0)

    def prewarm(self, nbytes: int, chunk: int = 8 << 20) -> int:
        """Touch up to ``nbytes`` of LMCache's pool now (allocate, write, free), so that the first writes and
        reads do not pay a page fault per 4 KiB of fresh pool; returns the bytes touched."""
        torch, objs, done = self._torch, [], 0
        try:
            while done < nbytes:
                # without busy_loop LMCache answers None when the pool is full (with it, it waits for room)
                obj = self._sm.allocate(torch.Size([chunk]), torch.uint8, eviction=False, busy_loop=False)
                if obj is None:
                    break
                obj.tensor.reshape(-1).numpy().fill(0)
                objs.append(obj)
                done += chunk
        except Exception:  # noqa: BLE001 - a pool that cannot allocate is warmed as far as it went
            pass
        for obj in objs:
            obj.ref_count_down()
        return done

    def _copy_in(self, chunks):
        """The encoded chunks copied into a buffer of LMCache's pool; None when the pool has no room."""
        torch = self._torch
        size = sum(len(c) for c in chunks)
        if size > self.cfg.pool_bytes:  # LMCache would wait for room forever (its allocate busy-loops)
            return None
        try:
            obj = self._sm.allocate(torch.Size([size]), torch.uint8)
        except Exception:  # noqa: BLE001
            obj = None
        if obj is None:
            return None
        # numpy's copy, not torch's: on a connector's save thread a torch copy starts an OpenMP team that
        # competes with vLLM's forward for the cores (connector.paged.unstage)
        view, off = obj.tensor.reshape(-1).numpy(), 0
        for c in chunks:
            n = len(c)
            view[off : off + n] = np.frombuffer(c, dtype=np.uint8)
            off += n
        return obj

    def wait_visible(self, key: StoreKey, timeout_s: float = 10.0) -> bool:
        """Block until an asynchronous put can be read back (tests, benchmarks, cross-process handoff)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.contains(key):
                return True
            time.sleep(0.002)
        return False

    def delete(self, key: StoreKey) -> bool:
        ck = self._key(key)
        if self.cfg.kind in ("cpu", "disk"):
            try:
                removed = bool(self._sm.remove(ck, locations=[self.backend]))
            except Exception:  # noqa: BLE001
                removed = False
            if self.cfg.kind == "disk":
                path = Path(self._disk()._key_to_path(ck))
                if path.exists():
                    path.unlink(missing_ok=True)
                    removed = True
            return removed
        if self.scheme == "redis":
            return self._redis_delete(ck)
        return False  # lmcache_server has no delete; a bad entry there is skipped on every read

    def stats(self) -> dict:
        out = self._stats.as_dict()
        if self.cfg.kind == "disk":
            out["entries"] = len(self._disk().dict)
            out["bytes"] = int(self._disk().current_cache_size)
        out["down"] = self._down_until != 0.0
        return out

    def close(self) -> None:
        """Close LMCache's manager; never hangs the caller (a stuck close is abandoned after 15 s)."""
        sm, self._sm = self._sm, None
        if sm is None:
            return
        t = threading.Thread(target=sm.close, daemon=True)
        t.start()
        t.join(timeout=15)
        if t.is_alive() and sm.loop.is_running():
            sm.loop.call_soon_threadsafe(sm.loop.stop)
        self._close_health()
