"""The planner's rendered-token caches, one set per tenant (``core.planner.Planner`` keeps them in an LRU of
tenants): how fast a request is planned must not tell one tenant that another sent the same document."""

from __future__ import annotations

from dataclasses import dataclass

from cachetools import LRUCache


def _ids_bytes(value: tuple) -> int:
    """Approximate bytes a cached token tuple holds (tuple slots + small ints), for the LRU bound."""
    if value and isinstance(value[0], tuple):  # a frame (three parts of pieces) or a part
        return sum(_ids_bytes(v) for v in value) + 56
    return 56 + 8 * len(value)


@dataclass(frozen=True, slots=True)
class TokenCacheStats:
    """One tenant's rendered-token caches: lookups that hit, lookups that missed, bytes held."""

    hits: int = 0
    misses: int = 0
    nbytes: int = 0


TENANT_OVERHEAD = 256  # bytes charged for a tenant's (empty) caches, so the tenant table's bound counts it


class TenantTokens:
    """One tenant's rendered-token caches: blocks (documents, skills) and chat frames, each half of
    ``nbytes``, so a long conversation cannot evict the documents."""

    __slots__ = ("blocks", "frames", "hits", "misses")

    def __init__(self, nbytes: int):
        self.blocks: LRUCache = LRUCache(nbytes // 2, getsizeof=_ids_bytes)
        self.frames: LRUCache = LRUCache(nbytes // 2, getsizeof=_ids_bytes)
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self.blocks.currsize + self.frames.currsize + TENANT_OVERHEAD
