"""Assemble a request's KV from cached spans: fetch or compile, re-position, recompute, prefill.

``SpanCache.assemble(plan)`` is the KV path of DESIGN.md's data flow:

    spans -> key -> store hit? (else compile and put) -> write at new positions (rotate while copying)
          -> select tokens to recompute (spans.recompute) -> one forward: recomputed + computed tokens
          -> logits of the next token, a KVCache ready to decode, and a ReuseReport

Layout: items take consecutive slots and positions in plan order (``PlanItem.position`` pins a
position instead). With ``block_size`` each reused span starts on a block boundary of slots; the gap is
padding, masked from attention, and takes no positions. ``separator`` tokens go between consecutive
reused spans and are computed in context.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from contextkit.core.kvcache import PAD_SEGMENT, KVCache
from contextkit.core.engine import KVEngine
from contextkit.core.errors import ConfigError, PromptTooLongError
from contextkit.kernels.rerotate import Rerotator
from contextkit.core.plan import RequestPlan, ReuseReport
from contextkit.spans.compile import compile_span, cut_span, model_identity, write_span
from contextkit.spans.key import SpanKey, span_key
from contextkit.spans.recompute import Layout, select
from contextkit.spans.store import CompiledSpan, KVSpanStore, SpanStore
from contextkit.core.tenant import Tenant
from contextkit.core.tenant_lru import TenantLRU
from contextkit.core.types import Span


@dataclass
class Assembly:
    """A request's context, ready to decode: ``logits`` (1, vocab) predict the first answer token."""

    cache: KVCache
    logits: torch.Tensor
    report: ReuseReport


def _tenant_of(key: SpanKey) -> str:
    return key.tenant  # every key of pending and borrowed names its tenant


@dataclass(frozen=True, slots=True)
class _Placed:
    slot: int
    position: int
    ids: tuple[int, ...]
    reuse: bool
    separator: bool = False


class SpanCache:
    """Compiles, stores and assembles span KV for one engine.

    Args:
        engine: the built-in engine.
        store: where compiled spans live (``kvstore`` tiers implement the same interface).
        rerotator: RoPE re-rotation kernels (path chosen by config).
        tokenizer_fingerprint: part of every key, so spans from another tokenizer never match.
        max_pending: entries of ``pending`` and of ``borrowed``, each.
        max_pending_per_key: of those, entries of one key tenant (its own and its sub-tenants'); None:
            a quarter of ``max_pending``, so one key's documents alone never drop another key's work.
    """

    def __init__(
        self,
        engine: KVEngine,
        store: SpanStore | None = None,
        rerotator: Rerotator | None = None,
        tokenizer_fingerprint: str = "",
        max_pending: int = 4096,
        max_pending_per_key: int | None = None,
    ):
        self.engine = engine
        self.store = store if store is not None else KVSpanStore()
        self.rerotator = rerotator or Rerotator()
        self.identity = model_identity(engine, tokenizer_fingerprint)
        # work for off the request path (compile_pending), oldest dropped past max_pending, and a key
        # tenant's own oldest past its share: spans a request computed in context that have no
        # position-free entry yet ("alone"), and anchored spans a request re-positioned that have no
        # exact prefix link at their place yet ("prefix": the spans from position 0 up to it)
        per_key = max_pending_per_key if max_pending_per_key is not None else max(1, max_pending // 4)
        self.pending: TenantLRU[SpanKey, tuple[str, tuple[Span, ...], Tenant | str]] = TenantLRU(
            max_pending, per_key, _tenant_of, "max_pending")
        self.max_pending = max_pending
        # position-free key -> the prefix link a request stored for the same tokens (same tenant): KV
        # computed in another request's context, reused re-positioned (per policy) until the
        # position-free compile lands, so a span seen once is a hit in any order from the next request
        # on, however busy the engine is (DEVELOPERS.md, "borrowed KV")
        self.borrowed: TenantLRU[SpanKey, SpanKey] = TenantLRU(max_pending, per_key, _tenant_of, "max_pending")

    def compile_pending(self, limit: int | None = None) -> int:
        """Do up to ``limit`` (all: None) units of the work requests left: compile spans they computed
        in context position-free (reused at any position later), and compute anchored spans in their
        place as exact prefix links. Returns how many units were done."""
        done = 0
        while self.pending and (limit is None or done < limit):
            key, (kind, spans, tenant) = self.pending.popitem()  # the oldest
            if key not in self.store:
                if kind == "alone":
                    self.compiled(spans[0], (), tenant)
                else:
                    self.extend_prefix(spans, tenant)
            done += 1
        return done

    def extend_prefix(self, spans: Sequence[Span], tenant: Tenant | str = "") -> int:
        """Store ``spans``, laid in order from position 0, as exact prefix links: the links already
        stored are reused, the rest computed in place. Returns the tokens computed."""
        if not spans:
            return 0
        total = sum(len(s.token_ids) for s in spans)
        cache = self.engine.new_cache(total)
        chain: SpanKey | None = None
        done = at = 0
        for span in spans:
            link = self._chain_key(span.token_ids, chain, tenant)
            entry = self.store.get(link)
            if entry is None:
                break
            write_span(self.engine, cache, entry, at, at, 0, self.rerotator)
            chain, at, done = link, at + entry.num_tokens, done + 1
        rest = spans[done:]
        if not rest:
            return 0
        ids = [t for s in rest for t in s.token_ids]
        self.engine.forward(cache, ids, positions=torch.arange(at, at + len(ids)), logits="none")
        for span in rest:
            chain = self._chain_key(span.token_ids, chain, tenant)
            slots = torch.arange(at, at + len(span.token_ids))
            self.store.put(cut_span(self.engine, cache, chain, span.token_ids, slots, self.rerotator))
            at += len(span.token_ids)
        return len(ids)

    def _queue(self, key: SpanKey, kind: str, spans: tuple[Span, ...], tenant: Tenant | str) -> None:
        self.pending[key] = (kind, spans, tenant)  # the newest: past a bound, the oldest of its key goes

    def _borrow(self, key: SpanKey, link: SpanKey) -> None:
        if key != link:
            self.borrowed[key] = link

    def _chain_key(self, item_tokens: tuple[int, ...], prev: SpanKey | None, tenant: Tenant | str) -> SpanKey:
        """The key of a span computed in place right after the exact prefix ``prev`` names (vLLM's
        automatic prefix caching on span keys: each link names the one before it, so a hit is exact)."""
        return span_key(self.identity, item_tokens, (prev,) if prev is not None else (), tenant)

    def compiled(
        self, span: Span, deps: tuple[CompiledSpan, ...] = (), tenant: Tenant | str = ""
    ) -> tuple[CompiledSpan, bool]:
        """The span's KV from the store, or compiled now and stored; and whether it was a hit."""
        key = span_key(self.identity, span.token_ids, tuple(d.key for d in deps), tenant)
        hit = self.store.get(key)
        if hit is not None:
            return hit, True
        entry = compile_span(self.engine, self.identity, span, self.rerotator, deps, tenant)
        self.store.put(entry)
        return entry, False

    def _layout(self, plan: RequestPlan) -> tuple[list[_Placed], list[int], int]:
        """Slots and positions of every item (separators interleaved); returns (placed, owner, slots)."""
        opts = plan.options
        placed: list[_Placed] = []
        owner: list[int] = []  # plan item index of each placed run (-1 = separator)
        slot = position = 0
        prev_reused = False
        for i, item in enumerate(plan.items):
            if item.reuse and prev_reused and opts.separator:
                placed.append(_Placed(slot, position, opts.separator, False, True))
                owner.append(-1)
                slot += len(opts.separator)
                position += len(opts.separator)
            if item.reuse and opts.block_size and slot % opts.block_size:
                slot += opts.block_size - slot % opts.block_size
            if item.position is not None:
                position = item.position
            placed.append(_Placed(slot, position, item.span.token_ids, item.reuse))
            owner.append(i)
            slot += len(item.span.token_ids)
            position += len(item.span.token_ids)
            prev_reused = item.reuse
        return placed, owner, slot

    def assemble(self, plan: RequestPlan, extra_capacity: int = 256,
                 provided: dict[int, CompiledSpan] | None = None) -> Assembly:
        """Build the request's KV per ``plan.options`` and prefill its query.

        Args:
            plan: spans in order, the last one the query (not reused).
            extra_capacity: free slots left in the cache for decoding.
            provided: KV the caller already holds for some reused items (plan index -> span, e.g. an
                agent branch's generated tokens): used instead of the store, counted as hits.
        """
        provided = provided or {}
        for i, span in provided.items():
            if not 0 <= i < len(plan.items) or not plan.items[i].reuse:
                raise ConfigError(f"provided KV for item {i}, which is not a reused item of the plan")
            if span.token_ids != plan.items[i].span.token_ids:
                raise ConfigError(f"provided KV for item {i} holds other tokens than the item")
            if span.key.identity != self.identity or span.problem(span.key) is not None:
                raise ConfigError(f"provided KV for item {i} is for another model or malformed "
                                  f"({span.problem(span.key) or 'model, tokenizer, dtype or RoPE differ'})")
        t_start = time.perf_counter()
        engine, opts = self.engine, plan.options
        if opts is None:
            raise ConfigError("this plan allows no span reuse (options=None): prefill plan.ids instead, or plan "
                              "the request with reuse=ReuseOptions(...)")
        placed, owner, n_slots = self._layout(plan)
        last_pos = max(p.position + len(p.ids) for p in placed)
        if last_pos + extra_capacity > engine.spec.max_positions:
            raise PromptTooLongError(
                f"the plan needs {last_pos} positions plus {extra_capacity} to decode, beyond the model's "
                f"context of {engine.spec.max_positions}; drop spans or lower max_new_tokens"
            )
        cache = engine.new_cache(n_slots + extra_capacity)
        context_tokens = sum(len(p.ids) for p in placed)

        if opts.policy == "full":  # no reuse: the plain prefill of the same tokens and positions
            ids = [t for p in placed for t in p.ids]
            pos = torch.cat([torch.arange(p.position, p.position + len(p.ids)) for p in placed])
            t0 = time.perf_counter()
            logits = engine.forward(cache, ids, positions=pos)
            compute = (time.perf_counter() - t0) * 1e3
            assert logits is not None
            report = ReuseReport(
                policy="full", ratio=1.0, context_tokens=context_tokens, reused_tokens=0, rerotated_tokens=0,
                recomputed_tokens=0, prefilled_tokens=context_tokens, padding_tokens=0, compiled_tokens=0,
                hits=0, misses=0, fetch_ms=0.0, rerotate_ms=0.0, select_ms=0.0, compute_ms=compute,
                compile_ms=0.0, total_ms=(time.perf_counter() - t_start) * 1e3,
            )
            return Assembly(cache, logits, report)

        # 1. fetch every reused span. Leading spans are looked up as an exact prefix first (each keyed
        # by the one before it); a span found nowhere is computed in the new context like the query
        # (stored as a prefix link when everything before it is exact, and queued for a position-free
        # compile off the request path); spans pinned to a position or declaring their own
        # dependencies are compiled on a miss as they were compiled before (dependencies first)
        compiled: dict[int, CompiledSpan] = {}
        misses = compiled_tokens = 0
        hit_items: list[int] = []
        exact: set[int] = set()
        in_context: dict[int, SpanKey | None] = {}  # item -> its prefix-link key (None: not exact)
        chain: SpanKey | None = None
        exact_run = not opts.separator
        compile_ms = fetch_ms = 0.0
        query_links: dict[int, SpanKey] = {}  # computed items kept as prefix links (a conversation's newest turn)
        for i, item in enumerate(plan.items):
            if not item.reuse:
                if item.exact and exact_run:
                    query_links[i] = self._chain_key(item.span.token_ids, chain, plan.tenant)
                exact_run = False
                continue
            t0 = time.perf_counter()
            free = item.position is None and not item.depends_on and i not in provided
            entry, hit = None, False
            if i in provided:  # approximate KV (an agent branch's): nothing after it is exact
                entry, hit = provided[i], True
                exact_run = False
            elif free:
                link = self._chain_key(item.span.token_ids, chain, plan.tenant) if exact_run else None
                if link is not None:
                    entry = self.store.get(link)
                if entry is not None:
                    exact.add(i)
                elif item.exact:  # a conversation turn: exact or computed, never re-positioned
                    in_context[i] = link
                else:
                    key = span_key(self.identity, item.span.token_ids, (), plan.tenant)
                    entry = self.store.get(key) if key != link else None
                    if entry is None and key in self.borrowed:  # until its position-free compile lands
                        entry = self.store.get(self.borrowed[key])
                    if entry is None:
                        in_context[i] = link
                        if key != link:
                            self._queue(key, "alone", (item.span,), plan.tenant)
                    elif item.anchor and link is not None:
                        # re-positioned now; its exact place is computed off the request path, so
                        # later requests with this prefix reuse it exactly
                        prefix = tuple(plan.items[j].span for j in range(i + 1))
                        self._queue(link, "prefix", prefix, plan.tenant)
                hit = entry is not None
                chain = link
                exact_run = exact_run and (i in exact or i in in_context)
            else:
                entry, hit = self.compiled(item.span, tuple(compiled[d] for d in item.depends_on), plan.tenant)
                exact_run = False
            elapsed = (time.perf_counter() - t0) * 1e3
            if i in in_context:
                misses += 1
                continue
            assert entry is not None
            compiled[i] = entry
            if hit:
                hit_items.append(i)
                fetch_ms += elapsed
            else:
                misses += 1
                compiled_tokens += entry.num_tokens
                compile_ms += elapsed

        # 2. lay them out at their new positions; everything else starts as masked padding
        t0 = time.perf_counter()
        cache.segments[:n_slots] = PAD_SEGMENT
        rerotated = 0
        for p, i in zip(placed, owner):
            if p.reuse and i >= 0 and i in compiled:
                write_span(engine, cache, compiled[i], p.slot, p.position, i, self.rerotator)
                rerotated += len(p.ids) if p.position else 0
        rerotate_ms = (time.perf_counter() - t0) * 1e3
        # the query's slots are appended by the final forward: the filled cache ends where it starts
        # (its positions are still -1 from allocation); spans computed in context stay masked padding
        # until that forward writes them
        layout = self._index(plan, placed, owner, exact, set(in_context))
        cache.length = int(layout.query.min())

        # 3. choose what to recompute
        t0 = time.perf_counter()
        selection = select(engine, cache, layout, opts)
        recompute = selection.slots
        if opts.recompute_last_span:
            reused_items = [i for i, it in enumerate(plan.items) if it.reuse]
            if reused_items:
                recompute = torch.cat([recompute, layout.item_slots[reused_items[-1]]]).unique()
                recompute = recompute[torch.isin(recompute, layout.candidates)]
        select_ms = (time.perf_counter() - t0) * 1e3

        # 4. one forward: recomputed tokens in place, computed tokens (separators, query) in context
        t0 = time.perf_counter()
        run = torch.isin(layout.slots, torch.cat([recompute, layout.computed]))
        logits = engine.forward(
            cache, layout.ids[run], positions=layout.positions[run], slots=layout.slots[run],
            segment=layout.segments[run],
        )
        compute_ms = (time.perf_counter() - t0) * 1e3
        assert logits is not None
        # spans computed in context after an exact prefix hold exact KV: keep them as prefix links
        for i, link in (*in_context.items(), *query_links.items()):
            if link is not None:
                slots = layout.item_slots[i]
                self.store.put(cut_span(engine, cache, link, plan.items[i].span.token_ids, slots, self.rerotator))
                if not plan.items[i].exact:
                    self._borrow(span_key(self.identity, plan.items[i].span.token_ids, (), plan.tenant), link)

        reused_total = sum(len(p.ids) for p, i in zip(placed, owner) if p.reuse and i not in in_context)
        from_hits = torch.cat([layout.item_slots[i] for i in hit_items]) if hit_items else recompute[:0]
        cached = int(from_hits.numel() - torch.isin(from_hits, recompute).sum())
        report = ReuseReport(
            policy=opts.policy,
            ratio=opts.ratio,
            context_tokens=context_tokens,
            reused_tokens=reused_total - recompute.numel(),
            rerotated_tokens=rerotated,
            recomputed_tokens=int(recompute.numel()),
            prefilled_tokens=int(layout.computed.numel()),
            padding_tokens=n_slots - context_tokens,
            compiled_tokens=compiled_tokens,
            hits=len(hit_items),
            misses=misses,
            cached_tokens=cached,
            fetch_ms=fetch_ms,
            rerotate_ms=rerotate_ms,
            select_ms=select_ms,
            compute_ms=compute_ms,
            compile_ms=compile_ms,
            total_ms=(time.perf_counter() - t_start) * 1e3,
            estimated_deviation=selection.estimated_deviation,
            recomputed_slots=tuple(recompute.tolist()),
            exact_tokens=sum(len(plan.items[i].span.token_ids) for i in exact),
        )
        return Assembly(cache, logits, report)

    @staticmethod
    def _index(plan: RequestPlan, placed: list[_Placed], owner: list[int], exact_items: set[int] = frozenset(),
               in_context: set[int] = frozenset()) -> Layout:
        ids, slots, pos, seg, item_slots = [], [], [], [], [torch.empty(0, dtype=torch.long)] * len(plan.items)
        computed, candidates = [], []
        trailing = len(placed)
        while trailing > 0 and not placed[trailing - 1].reuse:
            trailing -= 1
        query = []
        # a reused item is exact when it was compiled after every earlier item, in place, with
        # nothing computed in between: its KV is what a full prefill gives
        exact_prefix = True
        for j, (p, i) in enumerate(zip(placed, owner)):
            s = torch.arange(p.slot, p.slot + len(p.ids))
            ids.append(torch.tensor(p.ids))
            slots.append(s)
            pos.append(torch.arange(p.position, p.position + len(p.ids)))
            seg.append(torch.full((len(p.ids),), i if i >= 0 else len(plan.items) + j))
            if i >= 0:
                item_slots[i] = s
            if not p.reuse or i in in_context:
                computed.append(s)
                exact_prefix = False
                if j >= trailing:
                    query.append(s)
                continue
            item = plan.items[i]
            exact = exact_prefix and (i in exact_items or item.depends_on == tuple(range(i))) and \
                item.position in (None, p.position)
            expected = sum(len(q.ids) for q in placed[:j])
            exact = exact and p.position == expected
            if not exact:
                exact_prefix = False
                candidates.append(s)
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.long)  # noqa: E731
        return Layout(
            ids=cat(ids), slots=cat(slots), positions=cat(pos), segments=cat(seg), item_slots=tuple(item_slots),
            candidates=cat(candidates), computed=cat(computed), query=cat(query),
        )
