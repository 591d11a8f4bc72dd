"""The store interface and its counters (exported to Prometheus by ``kvstore.metrics``).

``KVStore`` is what every tier implements (memory, disk, remote) and what ``TieredStore`` composes.
Keys are any objects with ``digest`` (hex, names everything that determines the bytes) and
``tenant`` (the tenant's name); the span cache's ``SpanKey`` is one. The digest hashes public things (a
model's fingerprint, the tenant's name, token ids), so a tier that leaves the process writes neither it nor
the name: it writes keyed hashes of both (``kvstore.entry.StoreNames``). A store never returns an entry that
fails its checks: it drops it, counts it under ``corrupt`` and answers a miss, so the caller recomputes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from contextkit.core.stats import percentile
from contextkit.kvstore.entry import Entry


@runtime_checkable
class StoreKey(Protocol):
    @property
    def digest(self) -> str: ...

    @property
    def tenant(self) -> str: ...


COUNTERS = ("hits", "misses", "puts", "put_bytes", "get_bytes", "evictions", "corrupt", "errors")


@dataclass
class TierStats:
    """Counters and latency samples of one tier; thread-safe."""

    tier: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    get_ms: list[float] = field(default_factory=list)
    put_ms: list[float] = field(default_factory=list)
    bytes_stored: int = 0
    entries: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _max_samples: int = 4096

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def hit(self, nbytes: int, t0: float) -> None:
        """A served get of ``nbytes`` that started at ``t0``."""
        self.add("hits")
        self.add("get_bytes", nbytes)
        self.time("get", t0)

    def time(self, op: str, t0: float) -> None:
        samples = self.get_ms if op == "get" else self.put_ms
        with self._lock:
            samples.append((time.perf_counter() - t0) * 1e3)
            if len(samples) > self._max_samples:
                del samples[: len(samples) // 2]

    def as_dict(self) -> dict:
        with self._lock:
            out = {**self.counts, "bytes": self.bytes_stored, "entries": self.entries}
            for op, xs in (("get", self.get_ms), ("put", self.put_ms)):
                if xs:
                    out[f"{op}_ms_p50"] = round(percentile(xs, 50), 4)
                    out[f"{op}_ms_p99"] = round(percentile(xs, 99), 4)
            return out


class KVStore(Protocol):
    """One tier, or several behind one face. ``get`` returns ``None`` on a miss and on a dropped entry."""

    name: str

    def contains(self, key: StoreKey) -> bool: ...

    def get(self, key: StoreKey) -> Entry | None: ...

    def put(self, key: StoreKey, entry: Entry) -> None: ...

    def delete(self, key: StoreKey) -> bool: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...
