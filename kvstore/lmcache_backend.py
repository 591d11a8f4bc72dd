"""LMCache itself, set up for a tier: our config as LMCache's, its keys, and the patches it needs.

The LMCache side of ``kvstore.lmcache_tier`` (whose module docstring lists LMCache's sharp edges and
why each workaround exists): the mapping of ``LMCacheTierConfig`` onto ``LMCacheEngineConfig`` (the one
place it lives), the keyed ``CacheEngineKey`` of a ``StoreKey``, the process-wide fixes (Redis close,
a private Prometheus directory) and the disk backend's (atomic writes, reloading its files at start,
registering files another process wrote).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from contextkit.core.config import REMOTE_SCHEMES
from contextkit.kvstore.base import StoreKey
from contextkit.kvstore.entry import StoreNames

if TYPE_CHECKING:
    from contextkit.kvstore.lmcache_tier import LMCacheTierConfig

BACKEND = {"cpu": "LocalCPUBackend", "disk": "LocalDiskBackend", "remote": "RemoteBackend"}
_patch_lock = threading.Lock()
_patched = False


def lmcache_config(cfg: LMCacheTierConfig):
    """Our tier config as LMCache's own ``LMCacheEngineConfig`` (the one place the mapping lives).

    ``from_defaults`` ignores keys it does not know, so every key set here is checked by a test."""
    from lmcache.v1.config import LMCacheEngineConfig

    gib = 1 << 30
    kw: dict = {"chunk_size": 256, "remote_serde": "naive", "local_cpu": cfg.kind == "cpu",
                "max_local_cpu_size": (cfg.max_bytes if cfg.kind == "cpu" else cfg.pool_bytes) / gib,
                "blocking_timeout_secs": max(1, int(cfg.timeout_s))}
    if cfg.kind == "disk":
        kw.update(local_disk=str(cfg.disk_dir), max_local_disk_size=cfg.max_bytes / gib)
    if cfg.kind == "remote":
        url = cfg.remote_url  # checked against REMOTE_SCHEMES when the config was made
        params = REMOTE_SCHEMES[urllib.parse.urlparse(url).scheme].timeout_params
        if params:  # below the blocking timeout (see kvstore.lmcache_tier's module docstring)
            sock = max(0.5, cfg.timeout_s / 2)
            url += ("&" if "?" in url else "?") + "&".join(f"{name}={sock}" for name in params)
        kw.update(remote_url=url)
    return LMCacheEngineConfig.from_defaults(**kw)


def patch_redis_close() -> None:
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


def private_prometheus_dir() -> None:
    """Give this process a fresh ``PROMETHEUS_MULTIPROC_DIR`` unless it has one (kvstore.lmcache_tier's
    module docstring)."""
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="contextkit-prometheus-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
        atexit.register(shutil.rmtree, path, True)


# -- LMCache keys ------------------------------------------------------------------------------------
def chunk_hash(digest: str, *, names: StoreNames) -> int:
    """LMCache's chunk hash of a key: 64 bits of its keyed name, never of its digest (a public hash)."""
    return int(names.digest(digest)[:16], 16)


def tenant_tag(tenant: str, *, names: StoreNames) -> str:
    """A name-safe tag of the tenant for LMCache's model_name field (keys of tenants never meet), keyed:
    whoever reads the store can tell tenants apart but cannot tell which tenant is whose."""
    return "contextkit." + names.tenant(tenant)[:24]


def engine_key(key: StoreKey, *, mac_key: bytes):
    """LMCache's ``CacheEngineKey`` of ``key``, named with the keys derived from ``mac_key``."""
    import torch
    from lmcache.utils import CacheEngineKey

    names = StoreNames.of(mac_key)  # the names' key: derived from the secret, like the MAC's
    return CacheEngineKey(tenant_tag(key.tenant, names=names), 1, 0, chunk_hash(key.digest, names=names),
                          torch.uint8)


# -- disk workarounds --------------------------------------------------------------------------------
def atomic_disk_writes(db) -> None:
    """Make the disk backend ``db`` write through a temp file + ``os.replace``."""

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


def register_disk_file(db, path: Path) -> bool:
    """Tell LMCache's disk index ``db`` about a file it did not write in this process."""
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    try:
        model, ws, wid, h, _ = path.name.removesuffix(".pt").split("@")
        key = CacheEngineKey(model, int(ws), int(wid), int(h, 16), torch.uint8)  # file names hold hex
        size = path.stat().st_size
    except (ValueError, OSError):
        return False
    if db.contains(key):
        return True
    db.insert_key(key, size, torch.Size([size]), torch.uint8, MemoryFormat.KV_2LTD)
    with db.disk_lock:
        db.current_cache_size += size
        db.usage += size
    return True


def reload_disk_dir(db, disk_dir: Path) -> None:
    """Register the files an earlier process left in ``disk_dir`` (oldest first); drop half-written ones."""
    for p in sorted(Path(disk_dir).glob("*.pt"), key=lambda p: p.stat().st_mtime):
        register_disk_file(db, p)
    for p in Path(disk_dir).glob(".tmp-*.part"):  # a write that died mid-way
        p.unlink(missing_ok=True)
