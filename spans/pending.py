"""Work a request leaves for off the request path, and the KV lent until that work is done.

A request never waits for a compile. When it meets a span with no position-free entry it computes the
span in its own context and queues the position-free compile here ("alone"); when it re-positions an
anchored span that has no exact prefix link at its place, it queues the exact computation of that prefix
("prefix": the spans from position 0 up to it). ``SpanCache.compile_pending`` runs the queue, oldest first.

Meanwhile ``borrowed`` lends the KV the request did compute: position-free key -> the prefix link stored
for the same tokens (same tenant), computed in another request's context and reused re-positioned (per
policy) until the position-free compile lands. So a span seen once is a hit in any order from the next
request on, however busy the engine is (DEVELOPERS.md, "borrowed KV").

Both tables are bounded in all and per key tenant (``TenantLRU``), so one key's documents alone never
drop another key's work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contextkit.core.tenant import Tenant
from contextkit.core.tenant_lru import TenantLRU
from contextkit.core.types import Span
from contextkit.spans.key import SpanKey
from contextkit.spans.store import CompiledSpan, SpanStore

ALONE = "alone"  # compile one span position-free (it was computed in a request's context)
PREFIX = "prefix"  # compute spans laid from position 0 in place, as exact prefix links

# what a queued unit holds: its kind, the spans it computes, the tenant they belong to
Work = tuple[str, tuple[Span, ...], Tenant | str]


def _tenant_of(key: SpanKey) -> str:
    return key.tenant  # every key of pending and borrowed names its tenant


class PendingWork:
    """The queue of off-path work (``pending``) and the KV lent meanwhile (``borrowed``).

    Args:
        max_pending: entries of ``pending`` and of ``borrowed``, each.
        max_pending_per_key: of those, entries of one key tenant (its own and its sub-tenants'); None:
            a quarter of ``max_pending``.
    """

    def __init__(self, max_pending: int, max_pending_per_key: int | None = None):
        per_key = max_pending_per_key if max_pending_per_key is not None else max(1, max_pending // 4)
        # oldest dropped past max_pending, and a key tenant's own oldest past its share
        self.pending: TenantLRU[SpanKey, Work] = TenantLRU(max_pending, per_key, _tenant_of, "max_pending")
        self.borrowed: TenantLRU[SpanKey, SpanKey] = TenantLRU(max_pending, per_key, _tenant_of, "max_pending")

    def queue(self, key: SpanKey, kind: str, spans: tuple[Span, ...], tenant: Tenant | str) -> None:
        """Queue the unit that will store ``key`` (the newest: past a bound, the oldest of its key goes)."""
        self.pending[key] = (kind, spans, tenant)

    def lend(self, key: SpanKey, link: SpanKey) -> None:
        """Serve position-free ``key`` from prefix link ``link`` until its own compile lands."""
        if key != link:
            self.borrowed[key] = link

    def lent(self, key: SpanKey, store: SpanStore) -> CompiledSpan | None:
        """The KV lent for position-free ``key``, if any is lent and still stored."""
        if key in self.borrowed:
            return store.get(self.borrowed[key])
        return None

    def run(
        self,
        limit: int | None,
        store: SpanStore,
        alone: Callable[[Span, Tenant | str], object],
        prefix: Callable[[Sequence[Span], Tenant | str], object],
    ) -> int:
        """Do up to ``limit`` (all: None) units, oldest first, with ``alone`` / ``prefix`` per kind; a
        unit whose key got stored meanwhile is dropped undone (but counted). Returns the units taken."""
        done = 0
        while self.pending and (limit is None or done < limit):
            key, (kind, spans, tenant) = self.pending.popitem()  # the oldest
            if key not in store:
                if kind == ALONE:
                    alone(spans[0], tenant)
                else:
                    prefix(spans, tenant)
            done += 1
        return done
