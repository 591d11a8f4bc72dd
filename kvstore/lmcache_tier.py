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

import asyncio
import atexit
import concurrent.futures
import os
import shutil
import socket
import tempfile
import threading
import time
import urllib.parse
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from contextkit.core.errors import ConfigError
from contextkit.kvstore.base import StoreKey, TierStats
from contextkit.kvstore.deadline import Deadline
from contextkit.core.errors import CorruptEntryError
from contextkit.kvstore.entry import ENC_KEY_BYTES, MAC_BYTES, Entry, StoreNames, decode, encode

_BACKEND = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend", "remote": "RemoteBackend"}
_patch_lock = threading.Lock()
_patched = False


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
        if self.kind not in _BACKEND:
            raise ConfigError(f"LMCache tier kind must be cpu, disk or remote, got {self.kind!r}")
        if self.kind == "disk" and self.disk_dir is None:
            raise ConfigError("a disk tier needs disk_dir (a directory it may own)")
        if self.kind == "remote":
            url = urllib.parse.urlparse(self.remote_url or "")
            if url.scheme not in ("lm", "redis") or not url.hostname or not url.port:
                raise ConfigError(f"remote_url must be lm://host:port (lmcache_server) or redis://host:port, "
                                  f"got {self.remote_url!r}")
        if len(self.mac_key) != MAC_BYTES:
            raise ConfigError(f"an LMCache tier needs mac_key ({MAC_BYTES} bytes, "
                              "contextkit.core.tenancy.derive(secret, 'kv-mac')): entries that leave the process "
                              "are authenticated")
        if self.enc_key is not None and len(self.enc_key) != ENC_KEY_BYTES:
            raise ConfigError(f"enc_key must be {ENC_KEY_BYTES} bytes (contextkit.core.tenancy.derive(secret, 'kv-enc'))")
        if self.max_bytes <= 0 or self.pool_bytes <= 0 or self.timeout_s <= 0:
            raise ConfigError("max_bytes, pool_bytes and timeout_s must be positive")


def lmcache_config(cfg: LMCacheTierConfig):
    """Our tier config as LMCache's own ``LMCacheEngineConfig`` (the one place the mapping lives).

    ``from_defaults`` ignores keys it does not know, so every key set here is checked by a test."""
    from lmcache.v1.config import LMCacheEngineConfig

    gib = 1 << 30
    kw: dict = dict(chunk_size=256, remote_serde="naive", local_cpu=cfg.kind == "cpu",
                    max_local_cpu_size=(cfg.max_bytes if cfg.kind == "cpu" else cfg.pool_bytes) / gib,
                    blocking_timeout_secs=max(1, int(cfg.timeout_s)))
    if cfg.kind == "disk":
        kw.update(local_disk=str(cfg.disk_dir), max_local_disk_size=cfg.max_bytes / gib)
    if cfg.kind == "remote":
        url = cfg.remote_url or ""
        if url.startswith("redis://"):
            sock = max(0.5, cfg.timeout_s / 2)  # below the blocking timeout (see module docstring)
            url += ("&" if "?" in url else "?") + f"socket_timeout={sock}&socket_connect_timeout={sock}"
        kw.update(remote_url=url)
    return LMCacheEngineConfig.from_defaults(**kw)


def _patch_redis_close() -> None:
    """Replace ``RedisConnector.close`` (deadlocks: awaits a sync shutdown on its own loop)."""
    global _patched
    with _patch_lock:
        if _patched:
            return
        from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

        async def close(self) -> None:
            try:
                await asyncio.wait_for(self.pq_executor.shutdown_async(wait=True), 5)
            finally:
                await self.connection.aclose()

        RedisConnector.close = close
        _patched = True


def _private_prometheus_dir() -> None:
    """Give this process a fresh ``PROMETHEUS_MULTIPROC_DIR`` unless it has one (module docstring)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="contextkit-prometheus-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        atexit.register(shutil.rmtree, path, True)


def chunk_hash(digest: str, *, names: StoreNames) -> int:
    """LMCache's chunk hash of a key: 64 bits of its keyed name, never of its digest (a public hash)."""
    return int(names.digest(digest)[:16], 16)


def tenant_tag(tenant: str, *, names: StoreNames) -> str:
    """A name-safe tag of the tenant for LMCache's model_name field (keys of tenants never meet), keyed:
    whoever reads the store can tell tenants apart but cannot tell which tenant is whose."""
    return "contextkit." + names.tenant(tenant)[:24]


class LMCacheTier:
    """A kvstore tier on one LMCache backend. Thread-safe (LMCache's calls block; its loop is its own)."""

    def __init__(self, cfg: LMCacheTierConfig, name: str | None = None):
        # LMCache logs every tier start and every swallowed remote error at INFO/WARNING; our counters
        # (stats(): errors, corrupt, down) carry those events. LMCACHE_LOG_LEVEL set by you wins.
        os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
        _private_prometheus_dir()
        try:
            import torch
            from lmcache.v1.event_manager import EventManager
            from lmcache.v1.metadata import LMCacheMetadata
            from lmcache.v1.storage_backend.storage_manager import StorageManager
        except ImportError as exc:
            raise ConfigError("the LMCache tiers need lmcache: pip install 'contextkit[lmcache]'") from exc
        self.cfg = cfg
        self.name = name or (cfg.kind if cfg.kind != "remote" else urllib.parse.urlparse(cfg.remote_url).scheme)
        self.backend = _BACKEND[cfg.kind]
        self._stats = TierStats(self.name)
        self._torch = torch
        if cfg.kind == "remote" and (cfg.remote_url or "").startswith("redis://"):
            _patch_redis_close()
        if cfg.kind == "disk":
            Path(cfg.disk_dir).mkdir(parents=True, exist_ok=True)
        md = LMCacheMetadata(model_name="contextkit", world_size=1, local_world_size=1, worker_id=0,
                             local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 1, 256, 1, 1), chunk_size=256)
        self._sm = StorageManager(lmcache_config(cfg), md, EventManager())
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"kv-{self.name}")
        self._down_until = 0.0
        self._seen_failures = 0
        self._redis_client = None  # made on first use (_redis)
        self._lock = threading.Lock()
        if cfg.kind == "disk":
            self._disk_atomic_writes()
            self._disk_reload()
        if cfg.kind == "remote" and not self._probe():
            self._down_until = time.monotonic() + cfg.retry_after_s

    # -- LMCache keys ------------------------------------------------------------------------------
    def _key(self, key: StoreKey):
        from lmcache.utils import CacheEngineKey

        names = StoreNames.of(self.cfg.mac_key)  # the names' key: derived from the secret, like the MAC's
        return CacheEngineKey(tenant_tag(key.tenant, names=names), 1, 0, chunk_hash(key.digest, names=names),
                              self._torch.uint8)

    # -- disk workarounds --------------------------------------------------------------------------
    def _disk(self):
        return self._sm.storage_backends[self.backend]

    def _disk_atomic_writes(self) -> None:
        db = self._disk()

        def write_file(buffer, path):  # LMCache's own writes in place; a crash would leave half a file
            d = os.path.dirname(path)
            fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(buffer)
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise

        db.write_file = write_file

    def _register(self, path: Path) -> bool:
        """Tell LMCache's disk index about a file it did not write in this process."""
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat

        try:
            model, ws, wid, h, _ = path.name.removesuffix(".pt").split("@")
            key = CacheEngineKey(model, int(ws), int(wid), int(h, 16), self._torch.uint8)  # file names hold hex
            size = path.stat().st_size
        except (ValueError, OSError):
            return False
        db = self._disk()
        if db.contains(key):
            return True
        db.insert_key(key, size, self._torch.Size([size]), self._torch.uint8, MemoryFormat.KV_2LTD)
        with db.disk_lock:
            db.current_cache_size += size
            db.usage += size
        return True

    def _disk_reload(self) -> None:
        for p in sorted(Path(self.cfg.disk_dir).glob("*.pt"), key=lambda p: p.stat().st_mtime):
            self._register(p)
        for p in Path(self.cfg.disk_dir).glob(".tmp-*.part"):  # a write that died mid-way
            p.unlink(missing_ok=True)
        self._stats.entries = len(self._disk().dict)

    # -- remote health -----------------------------------------------------------------------------
    def _probe(self) -> bool:
        url = urllib.parse.urlparse(self.cfg.remote_url)
        try:
            socket.create_connection((url.hostname, url.port), timeout=min(1.0, self.cfg.timeout_s)).close()
            return True
        except OSError:
            return False

    def _note_failures(self) -> None:
        """LMCache swallows remote errors (logs them; a get answers None, a put fails in the background).
        Its backend counts failed puts, so we read that counter to learn that the connection broke (a
        dead ``lm://`` link never heals by itself). Its failed-get counter also counts plain misses, so a
        None from a get is checked with a TCP probe instead (``get``)."""
        be = self._sm.storage_backends.get(self.backend) if self._sm is not None else None
        seen = int(getattr(be, "_put_failed_count", 0))
        if seen > self._seen_failures:
            self._seen_failures = seen
            self._failed()

    def _available(self) -> bool:
        if self.cfg.kind != "remote":
            return True
        self._note_failures()
        if self._down_until == 0.0:
            return True
        if time.monotonic() < self._down_until:
            return False
        with self._lock:
            if self._down_until == 0.0:
                return True
            if not self._probe():
                self._down_until = time.monotonic() + self.cfg.retry_after_s
                return False
            try:  # a killed lm:// connection never recovers by itself
                self._sm.recreate_backend(self.backend)
                self._seen_failures = 0  # the new backend counts from zero
            except Exception:  # noqa: BLE001 - any failure here means: still down
                self._down_until = time.monotonic() + self.cfg.retry_after_s
                return False
            self._down_until = 0.0
            return True

    def _failed(self) -> None:
        self._stats.add("errors")
        if self.cfg.kind == "remote":
            self._down_until = time.monotonic() + self.cfg.retry_after_s

    def _call(self, fn, *args, timeout_s: float | None = None, on_abandon=None):
        """Run an LMCache call under the tier's deadline (remote) or directly (local). ``timeout_s``: what
        is left of a caller's deadline, when it is shorter. ``on_abandon(result)`` runs on a result that
        arrives after the caller gave up (to hand LMCache's buffers back)."""
        if self.cfg.kind != "remote":
            return fn(*args)
        wait = self.cfg.timeout_s if timeout_s is None else min(timeout_s, self.cfg.timeout_s)
        fut = self._pool.submit(fn, *args)
        try:
            return fut.result(timeout=wait)
        except concurrent.futures.TimeoutError:
            if on_abandon is not None:
                fut.add_done_callback(lambda f: f.cancelled() or f.exception() or on_abandon(f.result()))
            raise TimeoutError(f"{self.cfg.remote_url} did not answer within {wait:.3g} s") from None

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
            hit = path.is_file() and self._register(path)  # written by another process
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
        if (self.cfg.remote_url or "").startswith("redis://"):
            fn = lambda: self._redis_exists(cks)  # noqa: E731
        else:
            fn = lambda: [self._sm.contains(ck, [self.backend]) is not None for ck in cks]  # noqa: E731
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
            return [self.get(k) for k in keys]
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

    def _redis(self):
        """A plain Redis client on the remote's URL, for what LMCache's connector does one key at a time."""
        if self._redis_client is None:
            import redis

            url = urllib.parse.urlparse(self.cfg.remote_url)
            self._redis_client = redis.Redis(host=url.hostname, port=url.port, socket_timeout=self.cfg.timeout_s,
                                             socket_connect_timeout=self.cfg.timeout_s)
        return self._redis_client

    def _redis_exists(self, cks) -> list[bool]:
        pipe = self._redis().pipeline(transaction=False)
        for ck in cks:  # LMCache's RedisConnector writes <key>kv_bytes, then <key>metadata: the latter marks it
            pipe.exists(ck.to_string() + "metadata")
        return [bool(n) for n in pipe.execute()]

    def put(self, key: StoreKey, entry: Entry) -> None:
        """Submit the entry (LMCache writes disk and remote asynchronously: write-through, not waited on)."""
        t0 = time.perf_counter()
        entry.check_for(key)
        if not self._available():
            self._stats.add("errors")
            return
        chunks = encode(entry, self.cfg.mac_key, self.cfg.enc_key)
        size = sum(len(c) for c in chunks)
        torch = self._torch
        try:
            obj = self._sm.allocate(torch.Size([size]), torch.uint8)
        except Exception:  # noqa: BLE001
            obj = None
        if obj is None:  # LMCache's pool is full (or the entry is larger than it): not stored, counted
            self._stats.add("errors")
            return
        view = obj.tensor.reshape(-1)
        off = 0
        for c in chunks:
            if isinstance(c, bytes):
                c = bytearray(c)  # the header: small; torch wants a writable buffer to read from
            n = len(c)
            view[off : off + n].copy_(torch.frombuffer(c, dtype=torch.uint8) if n else view[:0])
            off += n
        try:
            self._call(self._sm.batched_put, [self._key(key)], [obj])
        except Exception:  # noqa: BLE001
            self._failed()
            return
        self._stats.add("puts")
        self._stats.add("put_bytes", size)
        self._stats.time("put", t0)

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
        if (self.cfg.remote_url or "").startswith("redis://"):
            return self._redis_delete(ck)
        return False  # lmcache_server has no delete; a bad entry there is skipped on every read

    def _redis_delete(self, ck) -> bool:
        url = urllib.parse.urlparse(self.cfg.remote_url)
        try:
            import redis

            r = redis.Redis(host=url.hostname, port=url.port, socket_timeout=self.cfg.timeout_s)
            name = ck.to_string()
            return bool(r.delete(name + "kv_bytes", name + "metadata"))
        except Exception:  # noqa: BLE001
            return False

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
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._redis_client is not None:
            self._redis_client.close()
