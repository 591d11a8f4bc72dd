"""The store interface and its metrics.

``KVStore`` is what every tier implements (memory, disk, remote) and what ``TieredStore`` composes.
Keys are any objects with ``digest`` (hex, names everything that determines the bytes) and
``namespace`` (tenant); the span cache's ``SpanKey`` is one. A store never returns an entry that fails
its checks: it drops it, counts it under ``corrupt`` and answers a miss, so the caller recomputes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from contextkit.kvstore.entry import Entry


@runtime_checkable
class StoreKey(Protocol):
    @property
    def digest(self) -> str: ...

    @property
    def namespace(self) -> str: ...


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
                    s = sorted(xs)
                    out[f"{op}_ms_p50"] = round(s[len(s) // 2], 4)
                    out[f"{op}_ms_p99"] = round(s[min(len(s) - 1, int(len(s) * 0.99))], 4)
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


class BatchMixin:
    """Default batched variants as loops; a tier with a native batch call overrides them."""

    def get_many(self, keys: Sequence[StoreKey]) -> list[Entry | None]:
        return [self.get(k) for k in keys]  # type: ignore[attr-defined]

    def put_many(self, items: Iterable[tuple[StoreKey, Entry]]) -> None:
        for k, e in items:
            self.put(k, e)  # type: ignore[attr-defined]

    def contains_many(self, keys: Sequence[StoreKey]) -> list[bool]:
        return [self.contains(k) for k in keys]  # type: ignore[attr-defined]


def prometheus(stats: dict[str, dict], prefix: str = "contextkit_kvstore") -> str:
    """Per-tier stats (``{tier: as_dict()}``) in the Prometheus text format."""
    lines = []
    kinds = {c: "counter" for c in COUNTERS} | {"bytes": "gauge", "entries": "gauge"}
    for name, kind in kinds.items():
        metric = f"{prefix}_{name}" + ("_total" if kind == "counter" else "")
        lines.append(f"# TYPE {metric} {kind}")
        for tier, s in stats.items():
            if name in s:
                lines.append(f'{metric}{{tier="{tier}"}} {s[name]}')
    for op in ("get", "put"):
        for q in ("p50", "p99"):
            metric = f"{prefix}_{op}_latency_ms_{q}"
            rows = [f'{metric}{{tier="{t}"}} {s[f"{op}_ms_{q}"]}' for t, s in stats.items() if f"{op}_ms_{q}" in s]
            if rows:
                lines += [f"# TYPE {metric} gauge", *rows]
    return "\n".join(lines) + "\n"
