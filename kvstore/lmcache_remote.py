"""A remote LMCache tier's health: every call under a deadline, down after a failure, a probe to come back.

``RemoteHealth`` is the part of ``kvstore.lmcache_tier.LMCacheTier`` that keeps a killed or stalled
remote (``lm://`` or Redis) from stalling its callers (the why is in that module's docstring): a remote
call runs on a small pool under the tier's deadline; a failure marks the tier down, later calls answer a
miss at once, and after ``retry_after_s`` a TCP probe decides whether to recreate LMCache's backend.
Also the plain Redis client for what LMCache's connector does one key at a time (batched EXISTS, delete).
Local tiers (cpu, disk) pass through: always available, calls run directly.
"""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from contextkit.kvstore.base import TierStats
    from contextkit.kvstore.lmcache_tier import LMCacheTierConfig


class RemoteHealth:
    """Mixed into ``LMCacheTier``; it sets ``cfg``, ``backend``, ``_sm`` and ``_stats``, and calls
    ``_init_health`` before any call."""

    cfg: LMCacheTierConfig
    backend: str
    _sm: Any  # LMCache's StorageManager; None once closed
    _stats: TierStats

    def _init_health(self, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"kv-{name}")
        self._down_until = 0.0
        self._seen_failures = 0
        self._redis_client = None  # made on first use (_redis)
        self._lock = threading.Lock()

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

    # -- plain Redis, beside LMCache's connector ---------------------------------------------------------
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

    def _redis_delete(self, ck) -> bool:
        url = urllib.parse.urlparse(self.cfg.remote_url)
        try:
            import redis

            r = redis.Redis(host=url.hostname, port=url.port, socket_timeout=self.cfg.timeout_s)
            name = ck.to_string()
            return bool(r.delete(name + "kv_bytes", name + "metadata"))
        except Exception:  # noqa: BLE001
            return False

    def _close_health(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._redis_client is not None:
            self._redis_client.close()
