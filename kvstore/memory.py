"""The memory tier: entries in this process's memory under a byte budget, evicted by cost, not age alone.

Eviction is GreedyDual-Size-Frequency: an entry's priority is ``L + hits * cost / size`` where cost is
what recomputing it takes (the entry's ``cost_ms``, its compile time) and ``L`` rises to the priority of
each evicted entry, so old entries age out while cheap-per-byte ones go first. With equal costs and
sizes this is LRU. Hits return the stored tensors without a copy (read-only by contract: the span cache
copies out of them while re-rotating).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

from contextkit.core.errors import ConfigError
from contextkit.kvstore.base import StoreKey, TierStats
from contextkit.kvstore.entry import Entry


class MemoryTier:
    name = "memory"

    def __init__(self, max_bytes: int = 2 << 30):
        if max_bytes <= 0:
            raise ConfigError(f"memory tier max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: dict[str, tuple[Entry, float, int]] = {}  # digest -> (entry, priority, hits)
        self._heap: list[tuple[float, int, str]] = []  # (priority, seq, digest); stale rows skipped
        self._seq = itertools.count()
        self._inflation = 0.0  # L
        self._lock = threading.Lock()
        self._stats = TierStats(self.name)

    def _priority(self, entry: Entry, hits: int) -> float:
        cost = max(entry.meta.cost_ms, 1e-3)
        return self._inflation + hits * cost / max(entry.nbytes, 1) * 1e6  # ms per MB

    def contains(self, key: StoreKey) -> bool:
        with self._lock:
            return key.digest in self._entries

    def get(self, key: StoreKey) -> Entry | None:
        t0 = time.perf_counter()
        with self._lock:
            row = self._entries.get(key.digest)
            if row is None:
                self._stats.add("misses")
                return None
            entry, _, hits = row
            if entry.meta.tenant != key.tenant or entry.meta.digest != key.digest:
                self._drop(key.digest)  # cannot happen through put(); checked anyway
                self._stats.add("corrupt")
                self._stats.add("misses")
                return None
            pr = self._priority(entry, hits + 1)
            self._entries[key.digest] = (entry, pr, hits + 1)
            heapq.heappush(self._heap, (pr, next(self._seq), key.digest))
            if len(self._heap) > 4 * len(self._entries) + 64:
                self._compact()
        self._stats.hit(entry.nbytes, t0)
        return entry

    def put(self, key: StoreKey, entry: Entry) -> None:
        t0 = time.perf_counter()
        entry.check_for(key)
        if entry.nbytes > self.max_bytes:
            return  # larger than the whole budget: not kept here
        entry = entry.owned()  # never keep a buffer LMCache lent
        with self._lock:
            if key.digest in self._entries:
                self._drop(key.digest)
            pr = self._priority(entry, 1)
            self._entries[key.digest] = (entry, pr, 1)
            heapq.heappush(self._heap, (pr, next(self._seq), key.digest))
            self._stats.bytes_stored += entry.nbytes
            while self._stats.bytes_stored > self.max_bytes:
                self._evict_one()
            self._stats.entries = len(self._entries)
        self._stats.add("puts")
        self._stats.add("put_bytes", entry.nbytes)
        self._stats.time("put", t0)

    def delete(self, key: StoreKey) -> bool:
        with self._lock:
            if key.digest not in self._entries:
                return False
            self._drop(key.digest)
            return True

    def _evict_one(self) -> None:
        while self._heap:
            pr, _, digest = heapq.heappop(self._heap)
            row = self._entries.get(digest)
            if row is not None and row[1] == pr:
                self._inflation = pr
                self._drop(digest)
                self._stats.add("evictions")
                return

    def _drop(self, digest: str) -> None:
        entry, _, _ = self._entries.pop(digest)
        self._stats.bytes_stored -= entry.nbytes
        self._stats.entries = len(self._entries)

    def _compact(self) -> None:
        self._heap = [(pr, next(self._seq), d) for d, (_, pr, _) in self._entries.items()]
        heapq.heapify(self._heap)

    def stats(self) -> dict:
        return self._stats.as_dict()

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._heap.clear()
            self._stats.bytes_stored = 0
            self._stats.entries = 0
