"""Assemble a request's KV from cached spans: fetch or compile, re-position, recompute, prefill.

``SpanCache.assemble(plan)`` is the KV path of DESIGN.md's data flow, one step per function:

    1. fetch (spans.fetch): per reused span, its exact prefix link, else its stored or lent KV (else
       compiled, or computed in the new context like the query, with the compile queued off the path)
    2. write (spans.layout): lay every item out at its slots and positions; write the fetched KV there,
       re-rotated while copying; the rest is masked padding until the forward computes it
    3. select (spans.recompute): which reused tokens to recompute in their new context
    4. forward: one forward of the recomputed tokens in place and the computed ones (separators, spans
       computed in context, the query) -> logits of the next token; spans computed after an exact
       prefix are kept as prefix links (spans.prefix)
    5. report: a ReuseReport of what was reused, recomputed and computed, and what each step cost

The work requests leave for later (position-free compiles, exact prefix links) and the KV lent meanwhile
live in ``spans.pending``; ``SpanCache.compile_pending`` runs that work off the request path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.errors import ConfigError, PromptTooLongError
from contextkit.core.kvcache import PAD_SEGMENT, KVCache
from contextkit.core.plan import RequestPlan, ReuseReport
from contextkit.core.policy import SPECS, Budgets, Resolved
from contextkit.core.tenant import Tenant
from contextkit.core.tenant_lru import TenantLRU
from contextkit.core.types import Span
from contextkit.kernels.rerotate import Rerotator
from contextkit.spans.calibration import CalibrationProfile
from contextkit.spans.compile import compile_span, cut_span, model_identity, write_span
from contextkit.spans.fetch import Fetched, fetch
from contextkit.spans.key import SpanKey, span_key
from contextkit.spans.layout import Placement, index, lay_out
from contextkit.spans.pending import PendingWork, Work
from contextkit.spans.prefix import extend_prefix
from contextkit.spans.recompute import Layout, key_shift, select
from contextkit.spans.store import CompiledSpan, KVSpanStore, SpanStore


@dataclass
class Assembly:
    """A request's context, ready to decode: ``logits`` (1, vocab) predict the first answer token."""

    cache: KVCache
    logits: torch.Tensor
    report: ReuseReport


@dataclass
class _Assembling:
    """One ``assemble`` call's state, handed from step to step (each step fills in its part)."""

    plan: RequestPlan
    placement: Placement
    cache: KVCache
    t_start: float
    budgeted: Resolved | None = None  # 0. the budget resolved (policy "budget" only)
    got: Fetched = field(default_factory=Fetched)  # 1. fetch
    layout: Layout | None = None  # 2. write
    rerotated: int = 0
    rerotate_ms: float = 0.0
    recompute: torch.Tensor | None = None  # 3. select: reused slots to recompute
    estimated_deviation: float | None = None
    select_ms: float = 0.0
    logits: torch.Tensor | None = None  # 4. forward
    compute_ms: float = 0.0
    shift: float | None = None  # how far the forward moved the recomputed tokens' keys


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
        profile: the engine's calibration profile (``spans.calibration``), which resolves
            policy="budget"; None: the built-in fallback, with a warning the first time.
    """

    def __init__(
        self,
        engine: KVEngine,
        store: SpanStore | None = None,
        rerotator: Rerotator | None = None,
        tokenizer_fingerprint: str = "",
        max_pending: int = 4096,
        max_pending_per_key: int | None = None,
        profile: CalibrationProfile | None = None,
    ):
        self.engine = engine
        self.budgets = Budgets(profile)
        self.store = store if store is not None else KVSpanStore()
        self.rerotator = rerotator or Rerotator()
        self.identity = model_identity(engine, tokenizer_fingerprint)
        self.work = PendingWork(max_pending, max_pending_per_key)  # see spans.pending
        self.max_pending = max_pending

    @property
    def profile(self) -> CalibrationProfile | None:
        """The calibration profile that resolves policy="budget" (None: the built-in default)."""
        return self.budgets.profile

    @property
    def pending(self) -> TenantLRU[SpanKey, Work]:
        """Work for off the request path, by the key it will store (``spans.pending``)."""
        return self.work.pending

    @property
    def borrowed(self) -> TenantLRU[SpanKey, SpanKey]:
        """Position-free key -> the prefix link lent for it until its compile lands (``spans.pending``)."""
        return self.work.borrowed

    def compile_pending(self, limit: int | None = None) -> int:
        """Do up to ``limit`` (all: None) units of the work requests left: compile spans they computed
        in context position-free (reused at any position later), and compute anchored spans in their
        place as exact prefix links. Returns how many units were done."""
        return self.work.run(limit, self.store, lambda span, tenant: self.compiled(span, (), tenant),
                             self.extend_prefix)

    def extend_prefix(self, spans: Sequence[Span], tenant: Tenant | str = "") -> int:
        """Store ``spans``, laid in order from position 0, as exact prefix links: the links already
        stored are reused, the rest computed in place. Returns the tokens computed."""
        return extend_prefix(self.engine, self.store, self.rerotator, self.identity, spans, tenant)

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
        self._check_provided(plan, provided)
        plan, budgeted = self._resolve(plan)
        a = self._start(plan, extra_capacity)
        a.budgeted = budgeted
        if plan.options.policy == "full":  # no reuse: the plain prefill of the same tokens and positions
            return self._full_prefill(a)
        a.got = fetch(self, plan, provided)
        self._write(a)
        self._select(a)
        self._forward(a)
        if self._over_gate(a):  # its recompute moved far: this request looks like the tail, it runs exact
            return self._full_prefill(a, escalated=True)
        self._keep_links(a)
        return Assembly(a.cache, a.logits, self._report(a))

    def _resolve(self, plan: RequestPlan) -> tuple[RequestPlan, Resolved | None]:
        """0. policy="budget": the profile's cheapest setting within the budget for the prompt's length
        band (or full prefill), else, with no profile, the built-in fallback (``core.policy.resolve_budget``,
        as in the vLLM connector)."""
        opts = plan.options
        if opts is None or opts.policy != "budget":
            return plan, None
        got = self.budgets.resolve(opts, plan.num_tokens)
        return replace(plan, options=got.options), got

    def _check_provided(self, plan: RequestPlan, provided: dict[int, CompiledSpan]) -> None:
        """Provided KV must be for a reused item, hold its tokens, and come from this model."""
        for i, span in provided.items():
            if not 0 <= i < len(plan.items) or not plan.items[i].reuse:
                raise ConfigError(f"provided KV for item {i}, which is not a reused item of the plan")
            if span.token_ids != plan.items[i].span.token_ids:
                raise ConfigError(f"provided KV for item {i} holds other tokens than the item")
            if span.key.identity != self.identity or span.problem(span.key) is not None:
                raise ConfigError(f"provided KV for item {i} is for another model or malformed "
                                  f"({span.problem(span.key) or 'model, tokenizer, dtype or RoPE differ'})")

    def _start(self, plan: RequestPlan, extra_capacity: int) -> _Assembling:
        """Check the plan fits, lay it out, allocate its cache (the clock starts here)."""
        t_start = time.perf_counter()
        if plan.options is None:
            raise ConfigError("this plan allows no span reuse (options=None): prefill plan.ids instead, or plan "
                              "the request with reuse=ReuseOptions(...)")
        placement = lay_out(plan)
        last_pos, limit = placement.last_position, self.engine.spec.max_positions
        if last_pos + extra_capacity > limit:
            raise PromptTooLongError(
                f"the plan needs {last_pos} positions plus {extra_capacity} to decode, beyond the model's "
                f"context of {limit}; drop spans or lower max_new_tokens"
            )
        cache = self.engine.new_cache(placement.n_slots + extra_capacity)
        return _Assembling(plan, placement, cache, t_start)

    @staticmethod
    def _over_gate(a: _Assembling) -> bool:
        """Whether the profile's tail gate for the chosen setting (``Resolved.tail_gate``) sends this request
        to full prefill: its recompute moved the keys it recomputed further than the gate."""
        gate = a.budgeted.tail_gate if a.budgeted is not None else None
        return gate is not None and a.shift is not None and a.shift > gate

    def _full_prefill(self, a: _Assembling, escalated: bool = False) -> Assembly:
        """Policy "full": every token computed in context, nothing reused (the reference). ``escalated``:
        the budget's setting ran first and the tail gate sent the request here (a fresh cache; the report
        keeps the reuse's shift, estimate and times, and the fetch's hits and compiles)."""
        if escalated:
            a.cache = self.engine.new_cache(a.cache.capacity)
        placed, context_tokens = a.placement.placed, a.placement.context_tokens
        ids = [t for p in placed for t in p.ids]
        pos = torch.cat([torch.arange(p.position, p.position + len(p.ids)) for p in placed])
        t0 = time.perf_counter()
        logits = self.engine.forward(a.cache, ids, positions=pos)
        compute = (time.perf_counter() - t0) * 1e3
        assert logits is not None
        got = a.got
        report = ReuseReport(
            policy="full", ratio=1.0, context_tokens=context_tokens, reused_tokens=0, rerotated_tokens=0,
            recomputed_tokens=0, prefilled_tokens=context_tokens, padding_tokens=0,
            compiled_tokens=got.compiled_tokens,
            hits=len(got.hit_items), misses=got.misses, fetch_ms=got.fetch_ms, rerotate_ms=a.rerotate_ms,
            select_ms=a.select_ms, compute_ms=compute, compile_ms=got.compile_ms,
            total_ms=(time.perf_counter() - a.t_start) * 1e3, estimated_deviation=a.estimated_deviation,
            recompute_shift=a.shift, escalated=escalated, **_budget_fields(a.budgeted),
        )
        return Assembly(a.cache, logits, report)

    def _write(self, a: _Assembling) -> None:
        """2. Write the fetched KV at its new slots and positions; everything else starts as masked padding."""
        t0 = time.perf_counter()
        a.cache.segments[:a.placement.n_slots] = PAD_SEGMENT
        for p, i in zip(a.placement.placed, a.placement.owner):
            if p.reuse and i >= 0 and i in a.got.entries:
                write_span(self.engine, a.cache, a.got.entries[i], p.slot, p.position, i, self.rerotator)
                a.rerotated += len(p.ids) if p.position else 0
        a.rerotate_ms = (time.perf_counter() - t0) * 1e3
        # the query's slots are appended by the final forward: the filled cache ends where it starts
        # (its positions are still -1 from allocation); spans computed in context stay masked padding
        # until that forward writes them
        a.layout = index(a.plan, a.placement, a.got.exact, set(a.got.in_context))
        a.cache.length = int(a.layout.query.min())

    def _select(self, a: _Assembling) -> None:
        """3. Choose the reused tokens to recompute in their new context."""
        opts, layout = a.plan.options, a.layout
        t0 = time.perf_counter()
        selection = select(self.engine, a.cache, layout, opts)
        recompute = selection.slots
        if opts.recompute_last_span:
            reused_items = [i for i, it in enumerate(a.plan.items) if it.reuse]
            if reused_items:
                recompute = torch.cat([recompute, layout.item_slots[reused_items[-1]]]).unique()
                recompute = recompute[torch.isin(recompute, layout.candidates)]
        a.select_ms = (time.perf_counter() - t0) * 1e3
        a.recompute, a.estimated_deviation = recompute, selection.estimated_deviation

    def _forward(self, a: _Assembling) -> None:
        """4. One forward: recomputed tokens in place, computed tokens (separators, query) in context."""
        layout = a.layout
        t0 = time.perf_counter()
        run = torch.isin(layout.slots, torch.cat([a.recompute, layout.computed]))
        stale = a.cache.k[:, :, a.recompute].clone() if a.recompute.numel() else None
        a.logits = self.engine.forward(
            a.cache, layout.ids[run], positions=layout.positions[run], slots=layout.slots[run],
            segment=layout.segments[run],
        )
        if stale is not None:
            a.shift = key_shift(stale, a.cache.k[:, :, a.recompute])
        a.compute_ms = (time.perf_counter() - t0) * 1e3
        assert a.logits is not None

    def _keep_links(self, a: _Assembling) -> None:
        """Spans computed in context after an exact prefix hold exact KV: keep them as prefix links, and
        lend them to their position-free keys until those compiles land."""
        items = a.plan.items
        for i, link in (*a.got.in_context.items(), *a.got.query_links.items()):
            if link is not None:
                slots = a.layout.item_slots[i]
                self.store.put(cut_span(self.engine, a.cache, link, items[i].span.token_ids, slots, self.rerotator))
                if not items[i].exact:
                    self.work.lend(span_key(self.identity, items[i].span.token_ids, (), a.plan.tenant), link)

    def _report(self, a: _Assembling) -> ReuseReport:
        """5. What this assembly reused, recomputed and computed, and what each step cost."""
        got, layout, recompute, placement = a.got, a.layout, a.recompute, a.placement
        context_tokens = placement.context_tokens
        reused_total = sum(len(p.ids) for p, i in zip(placement.placed, placement.owner)
                           if p.reuse and i not in got.in_context)
        from_hits = torch.cat([layout.item_slots[i] for i in got.hit_items]) if got.hit_items else recompute[:0]
        cached = int(from_hits.numel() - torch.isin(from_hits, recompute).sum())
        return ReuseReport(
            policy=a.plan.options.policy,
            ratio=a.plan.options.ratio,
            probe_layers=a.plan.options.probe_layers if a.plan.options.policy == "query_attention" else None,
            first_k=a.plan.options.first_k if SPECS[a.plan.options.policy].recomputes else None,
            context_tokens=context_tokens,
            reused_tokens=reused_total - recompute.numel(),
            rerotated_tokens=a.rerotated,
            recomputed_tokens=int(recompute.numel()),
            prefilled_tokens=int(layout.computed.numel()),
            padding_tokens=placement.n_slots - context_tokens,
            compiled_tokens=got.compiled_tokens,
            hits=len(got.hit_items),
            misses=got.misses,
            cached_tokens=cached,
            fetch_ms=got.fetch_ms,
            rerotate_ms=a.rerotate_ms,
            select_ms=a.select_ms,
            compute_ms=a.compute_ms,
            compile_ms=got.compile_ms,
            total_ms=(time.perf_counter() - a.t_start) * 1e3,
            estimated_deviation=a.estimated_deviation,
            recompute_shift=a.shift,
            recomputed_slots=tuple(recompute.tolist()),
            exact_tokens=sum(len(a.plan.items[i].span.token_ids) for i in got.exact),
            **_budget_fields(a.budgeted),
        )


def _budget_fields(b: Resolved | None) -> dict:
    return {} if b is None else {"fidelity_budget": b.budget, "profile": b.profile, "band": b.band,
                                 "tail_gate": b.tail_gate}

