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

from dataclasses import dataclass, field, replace
from typing import Literal

from contextkit.core.errors import ConfigError, EmptyInputError, InputError
from contextkit.core.tenant import Tenant
from contextkit.core.types import Doc, Span

Policy = Literal["budget", "none", "kv_deviation", "query_attention", "first_k", "full"]
POLICIES: tuple[str, ...] = ("budget", "none", "kv_deviation", "query_attention", "first_k", "full")
# The answer KL (nats per answer token, bounded for 90% of prompts by the calibration profile:
# ``spans.calibration.upper_bound``) ``policy="budget"`` allows when the request names none. Chosen on the
# tune half of the dev file (docs/benchmarks.md, "Fidelity budget").
DEFAULT_FIDELITY_BUDGET = 0.1
DEFAULT_RATIO, DEFAULT_MAX_RECOMPUTE = 0.3, 512  # query_attention's; what policy="budget" runs with no profile


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
class ReuseOptions:
    """Which reuse a request allows and how much it recomputes.

    Attributes:
        policy: selective recomputation policy (spans/recompute.py); "full" = no reuse at all. "budget"
            (the default): the cheapest setting whose calibrated answer KL is within ``fidelity_budget``
            for the prompt's length, from the model's calibration profile (``contextkit calibrate``,
            spans/calibration.py); a model with no profile gets query_attention with the fields below and
            a warning, and the reuse report says which profile (or none) chose.
        ratio: fraction r of reused span tokens to recompute (kv_deviation, query_attention), at most
            ``max_recompute`` tokens.
        max_recompute: a cap on the tokens ``ratio`` picks (None: no cap). The tokens a question needs
            recomputed sit in the few passages it reads, not in every passage: measured on the tune half
            of the dev file, ~450 tokens gave next-token KL ~0.03 both at 1.5k tokens (r=0.3) and at 4k
            (r=0.1), so a fixed ratio either over-spends on long contexts or under-spends on short ones.
        fidelity_budget: policy="budget" only: the answer KL allowed (nats per answer token, at the
            profile's quantile over calibration prompts of the prompt's length band), in (0, 1]; None:
            ``DEFAULT_FIDELITY_BUDGET``.
        attention_budget: instead of ``ratio`` (query_attention only): recompute until the estimated
            share of the query's attention that lands on stale KV is at most this. An estimate, not a
            bound on anything a user observes (0.2 came to next-token KL p90 0.128): prefer the budget.
        first_k: tokens recomputed at the start of each reused span, on top of any policy's choice
            (alone with policy="first_k"): a span compiled alone makes its first tokens attention
            sinks that the new context does not have.
        check_layer: the layer whose K deviation ranks tokens (kv_deviation).
        probe_layers: query_attention: run the query probe through only the first this many layers
            and score from them (0 = all layers). The probe was ~20% of the default's time over all 30
            of SmolLM2's layers; the first 8 chose as well (same KL and top-1 on the tune half).
        recompute_last_span: also recompute every token of the last reused span (Block-Attention).
        block_size: align span starts to this many slots (0 = off); the gap is masked padding.
        separator: token ids placed between consecutive reused spans, computed in context.
    """

    policy: Policy = "budget"
    ratio: float = DEFAULT_RATIO
    max_recompute: int | None = DEFAULT_MAX_RECOMPUTE
    fidelity_budget: float | None = None
    attention_budget: float | None = None
    first_k: int = 2
    check_layer: int = 1
    probe_layers: int = 8
    recompute_last_span: bool = False
    block_size: int = 0
    separator: tuple[int, ...] = ()

    @property
    def budget(self) -> float:
        """The answer-KL budget policy="budget" works to (``fidelity_budget`` or the default)."""
        return DEFAULT_FIDELITY_BUDGET if self.fidelity_budget is None else self.fidelity_budget

    def fallback(self) -> ReuseOptions:
        """What policy="budget" runs when no calibration profile can choose: query_attention with this
        request's ratio, cap, sinks and probe (the built-in default, chosen on the tune half)."""
        return replace(self, policy="query_attention", fidelity_budget=None)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown recompute policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.policy == "budget" and (self.ratio, self.max_recompute) != (DEFAULT_RATIO, DEFAULT_MAX_RECOMPUTE):
            raise ConfigError(f"ratio={self.ratio}, max_recompute={self.max_recompute} with policy='budget' (the "
                              "default): the budget chooses them from the model's calibration profile; pass "
                              "policy='query_attention' (or kv_deviation) to fix a ratio yourself")
        if self.fidelity_budget is not None:
            if self.policy != "budget":
                raise ConfigError(f"fidelity_budget needs policy='budget' (got {self.policy!r}); for the attention "
                                  "estimate under query_attention use attention_budget")
            if not 0.0 < self.fidelity_budget <= 1.0:
                raise InputError(f"fidelity_budget must be in (0, 1] (answer KL in nats per token), got "
                                 f"{self.fidelity_budget}", param="fidelity_budget")
        if self.attention_budget is not None:
            if self.policy != "query_attention":
                raise ConfigError("attention_budget needs policy='query_attention' (it is estimated from attention)")
            if not 0.0 <= self.attention_budget <= 1.0:
                raise ConfigError(f"attention_budget must be in [0, 1], got {self.attention_budget}")
        if self.first_k < 0 or self.block_size < 0:
            raise ConfigError("first_k and block_size must be >= 0")
        if not all(type(t) is int and t >= 0 for t in self.separator):
            raise ConfigError(f"separator must be token ids (ints >= 0), got {self.separator!r:.80}")
        if self.policy == "first_k" and self.first_k == 0:
            raise ConfigError("policy='first_k' needs first_k >= 1")
        if self.max_recompute is not None and self.max_recompute < 0:
            raise ConfigError(f"max_recompute must be >= 0 or None (no cap), got {self.max_recompute}")
        if self.probe_layers < 0:
            raise ConfigError(f"probe_layers must be >= 0 (0 = all layers), got {self.probe_layers}")
        if self.check_layer < 0:
            raise ConfigError(f"check_layer must be >= 0, got {self.check_layer}")


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
                raise ConfigError(f"item {i} is computed in context anyway; depends_on and anchor apply to reused spans")
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
