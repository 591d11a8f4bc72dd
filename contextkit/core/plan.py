"""A request as contextkit sees it: spans in order, what may be reused, and what was.

One ``RequestPlan`` serves both paths (DESIGN.md): the prompt path renders its tokens in order for an
unmodified engine; the KV path assembles cached span KV at new positions. The MiniPIC primitives and
the published reuse schemes are configurations of ``ReuseOptions``, not separate code paths:

| scheme          | how to express it                                                              |
|-----------------|--------------------------------------------------------------------------------|
| Block-Attention | spans compiled alone (default), ``recompute_last_span=True``, query prefilled   |
| EPIC            | ``policy="first_k"``, ``first_k=k`` (recompute each span's first k tokens)      |
| Prompt Cache    | ``PlanItem(position=p)``: modules at fixed schema positions                      |
| CacheBlend      | ``policy="kv_deviation"``, ``ratio=r`` (top-r tokens by K deviation at a layer)  |
| prompt depend   | ``PlanItem(depends_on=(i, ...))``: compiled after those items, keyed by them     |
| block alignment | ``block_size=B``: each span starts on a slot multiple of B (padding is masked)   |
| separators      | ``separator=ids``: tokens between spans, always computed in the new context      |
| vLLM APC        | automatic: leading spans stored as exact prefix links are reused exactly         |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contextkit.core.errors import ConfigError, EmptyInputError
from contextkit.core.policy import ReuseOptions  # the recompute policy's options live there
from contextkit.core.tenant import Tenant
from contextkit.core.types import Doc, Span


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One span of a request.

    Attributes:
        span: the tokens.
        reuse: False for tokens that are always computed in the new context (the question).
        position: fixed logical position (Prompt Cache schemas); None = right after the previous item.
        depends_on: indices of earlier items this span's KV was computed after (prompt depend).
        anchor: the span sits at one canonical place (a skill after the system prompt): when it
            continues an exact prefix that has no link for it yet, it is re-positioned for this request
            and computed in its place off the request path (``SpanCache.compile_pending``), so later
            requests with that prefix reuse it exactly, nothing recomputed.
        exact: reused only as an exact prefix (a prefix link: the same tokens after the same spans, for
            the same tenant), else computed in the new context; never re-positioned. A conversation's
            turns: their KV depends on every turn before them, so elsewhere they are new tokens. On an
            item that is not reused (the query) it means: once computed after an exact prefix, keep it
            as a prefix link (the next request of the conversation starts with it).
    """

    span: Span
    reuse: bool = True
    position: int | None = None
    depends_on: tuple[int, ...] = ()
    anchor: bool = False
    exact: bool = False


@dataclass(frozen=True, slots=True)
class RequestPlan:
    """A request ready to run: its spans in order, what may be reused, and how it was planned.

    Made by ``contextkit.core.planner.Planner`` for every entry point (or by hand, for the span cache
    alone). The prompt path sends ``ids`` to the engine as they are; the KV path assembles ``items``.

    Attributes:
        items: the spans in order; the last one is the query (computed in context).
        options: the reuse the request allows on the KV path; None: none (a plain prefill of ``ids``).
        tenant: whose cached state the request may use.
        order: the documents in served order, as indices into the request's documents.
        document_ids: the ids of the documents, in served order.
        served: the documents in served order as an orderer records them (id, rendered tokens).
        expected_cached_tokens: the orderer's estimate of the prefix an engine already holds (None:
            not ordered by a prefix tree).
        padding_tokens: pad tokens inside ``items`` (prompt-path block alignment).
        max_new_tokens: the tokens the request may generate (counted in the length check).
    """

    items: tuple[PlanItem, ...]
    options: ReuseOptions | None = field(default_factory=ReuseOptions)
    tenant: Tenant = field(default_factory=Tenant)
    order: tuple[int, ...] = ()
    document_ids: tuple[str, ...] = ()
    served: tuple[Doc, ...] = ()
    expected_cached_tokens: int | None = None
    padding_tokens: int = 0
    max_new_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.items:
            raise EmptyInputError("the plan has no spans; give it at least the question")
        for i, item in enumerate(self.items):
            if any(not 0 <= d < i for d in item.depends_on):
                raise ConfigError(f"item {i} depends on {item.depends_on}; it may depend only on earlier items")
            if (item.depends_on or item.anchor) and not item.reuse:
                raise ConfigError(f"item {i} is computed in context anyway; "
                                  "depends_on and anchor apply to reused spans")
        if self.items[-1].reuse:
            raise ConfigError("the last item must be the query (reuse=False): its logits start the answer")

    @property
    def num_tokens(self) -> int:
        return sum(len(it.span.token_ids) for it in self.items)

    @property
    def ids(self) -> list[int]:
        """The whole prompt: every item's tokens in order (what the prompt path sends)."""
        return [t for it in self.items for t in it.span.token_ids]

    @property
    def reordered(self) -> bool:
        return self.order != tuple(range(len(self.order)))


@dataclass(frozen=True, slots=True)
class ReuseReport:
    """What a request reused, re-rotated, recomputed and prefilled (tokens) and where the time went (ms)."""

    policy: str
    ratio: float
    context_tokens: int  # tokens in the assembled context (without padding)
    reused_tokens: int  # span tokens served from cached KV and not recomputed
    rerotated_tokens: int  # reused tokens whose keys were moved to a new position
    recomputed_tokens: int  # reused-span tokens recomputed in the new context
    prefilled_tokens: int  # tokens computed in context: query, separators, spans with no KV yet (all, for "full")
    padding_tokens: int
    compiled_tokens: int  # span tokens compiled on a cache miss during this request
    hits: int
    misses: int
    fetch_ms: float
    rerotate_ms: float
    select_ms: float
    compute_ms: float  # recompute + prefill forward
    compile_ms: float
    total_ms: float
    estimated_deviation: float | None = None  # query_attention: attention share left on stale KV
    # policy="budget": the budget asked for, the calibration profile that chose (its id; "none": no
    # profile, the built-in fallback ran) and the length band it chose for
    fidelity_budget: float | None = None
    profile: str | None = None
    band: str | None = None
    cached_tokens: int = 0  # reused tokens of spans already stored before this request (hits): usage's cached
    recomputed_slots: tuple[int, ...] = ()
    exact_tokens: int = 0  # reused tokens of an exact prefix (computed before after the same prefix)
    probe_layers: int | None = None  # query_attention: the probe's depth (0: all layers); None otherwise
    # tokens recomputed at the start of each reused span (first_k's k; the sinks under query_attention and
    # kv_deviation); None where nothing is recomputed ("none", "full")
    first_k: int | None = None
    # the mean relative change of K at the recomputed tokens (over layers and KV heads): how far recomputing
    # moved them, the tail gate's signal (None: nothing recomputed)
    recompute_shift: float | None = None
    # policy="budget": the shift was over the profile's tail gate (``tail_gate``), so the request ran as a
    # full prefill after its reuse (``policy`` "full"; the shift and the reuse's times kept)
    escalated: bool = False
    tail_gate: float | None = None
