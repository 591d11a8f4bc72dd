"""Step 1 of assembly: find the KV of every reused item of a plan, or decide to compute it in context.

Per reused item, in plan order:

- KV the caller provided (an agent branch's): used as it is; approximate, so nothing after it is exact.
- A free item (no pinned position, no declared dependencies), while everything before it is exact: its
  exact prefix link (``spans.prefix``). Otherwise its position-free entry, else KV lent for it
  (``spans.pending``, "borrowed"). Found nowhere (or a conversation turn, ``PlanItem.exact``, which is
  never re-positioned): computed in the new context like the query, and stored as a prefix link when
  everything before it is exact; its position-free compile is queued off the request path. An anchored
  span re-positioned here gets the exact computation of its place queued.
- An item pinned to a position or declaring dependencies: compiled on a miss as it was compiled
  before (dependencies first).

Computed items that follow an exact prefix (the query too, when ``exact``) are noted with their link
key, for assembly to store once the final forward has computed them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from contextkit.core.plan import RequestPlan
from contextkit.spans.key import SpanKey, span_key
from contextkit.spans.pending import ALONE, PREFIX
from contextkit.spans.prefix import chain_key
from contextkit.spans.store import CompiledSpan

if TYPE_CHECKING:
    from contextkit.spans.assemble import SpanCache


@dataclass
class Fetched:
    """What step 1 found, per plan item index, and what it cost."""

    entries: dict[int, CompiledSpan] = field(default_factory=dict)  # KV to write at the item's place
    hit_items: list[int] = field(default_factory=list)  # entries found (or provided), in plan order
    exact: set[int] = field(default_factory=set)  # found as exact prefix links
    in_context: dict[int, SpanKey | None] = field(default_factory=dict)  # reused items computed in context
    #   -> the prefix-link key to store them under (None: not after an exact prefix)
    query_links: dict[int, SpanKey] = field(default_factory=dict)  # computed items kept as prefix links
    #   (a conversation's newest turn)
    misses: int = 0
    compiled_tokens: int = 0
    fetch_ms: float = 0.0
    compile_ms: float = 0.0

    def count(self, i: int, entry: CompiledSpan | None, hit: bool, elapsed_ms: float) -> None:
        """Account item ``i``: computed in context (a miss), or its entry, found or compiled now."""
        if i in self.in_context:
            self.misses += 1
            return
        assert entry is not None
        self.entries[i] = entry
        if hit:
            self.hit_items.append(i)
            self.fetch_ms += elapsed_ms
        else:
            self.misses += 1
            self.compiled_tokens += entry.num_tokens
            self.compile_ms += elapsed_ms


@dataclass
class _Chain:
    """The exact prefix walked so far: the last link's key, and whether every item up to here is exact."""

    link: SpanKey | None
    exact: bool


def fetch(spans: SpanCache, plan: RequestPlan, provided: dict[int, CompiledSpan]) -> Fetched:
    """Find or compile the KV of every reused item of ``plan`` (see the module docstring)."""
    got = Fetched()
    chain = _Chain(None, not plan.options.separator)  # separators break exactness from the start
    for i, item in enumerate(plan.items):
        if not item.reuse:
            if item.exact and chain.exact:
                got.query_links[i] = chain_key(spans.identity, item.span.token_ids, chain.link, plan.tenant)
            chain.exact = False
            continue
        t0 = time.perf_counter()
        if i in provided:  # approximate KV (an agent branch's): nothing after it is exact
            entry, hit = provided[i], True
            chain.exact = False
        elif item.position is None and not item.depends_on:
            entry = _fetch_free(spans, plan, i, chain, got)
            hit = entry is not None
        else:
            deps = tuple(got.entries[d] for d in item.depends_on)
            entry, hit = spans.compiled(item.span, deps, plan.tenant)
            chain.exact = False
        got.count(i, entry, hit, (time.perf_counter() - t0) * 1e3)
    return got


def _fetch_free(spans: SpanCache, plan: RequestPlan, i: int, chain: _Chain, got: Fetched) -> CompiledSpan | None:
    """A free item: its exact prefix link while the chain is exact, else re-positioned KV; None when it
    is computed in context (noted in ``got.in_context``). Advances ``chain`` past the item."""
    item = plan.items[i]
    link = chain_key(spans.identity, item.span.token_ids, chain.link, plan.tenant) if chain.exact else None
    entry = spans.store.get(link) if link is not None else None
    if entry is not None:
        got.exact.add(i)
    elif item.exact:  # a conversation turn: exact or computed, never re-positioned
        got.in_context[i] = link
    else:
        entry = _fetch_moved(spans, plan, i, link, got)
    chain.link = link
    chain.exact = chain.exact and (i in got.exact or i in got.in_context)
    return entry


def _fetch_moved(spans: SpanCache, plan: RequestPlan, i: int, link: SpanKey | None,
                 got: Fetched) -> CompiledSpan | None:
    """A free item's KV to re-position: its position-free entry, else KV lent for it; queues the work
    that makes the next request's lookup better."""
    item = plan.items[i]
    key = span_key(spans.identity, item.span.token_ids, (), plan.tenant)
    entry = spans.store.get(key) if key != link else None
    if entry is None:  # until its position-free compile lands
        entry = spans.work.lent(key, spans.store)
    if entry is None:
        got.in_context[i] = link
        if key != link:
            spans.work.queue(key, ALONE, (item.span,), plan.tenant)
    elif item.anchor and link is not None:
        # re-positioned now; its exact place is computed off the request path, so later requests
        # with this prefix reuse it exactly
        spans.work.queue(link, PREFIX, tuple(it.span for it in plan.items[: i + 1]), plan.tenant)
    return entry
