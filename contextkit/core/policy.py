"""The recompute policy, in one place: its names, where each runs, its options, and how "budget" resolves.

A span-reuse request carries one ``ReuseOptions`` from the client to whichever path runs it: the built-in
engine (``spans/assemble.py``) or vLLM through the KV connector (the proxy encodes the options with
``integrations/vllm_connector/wire.py``; the connector's scheduler decodes them into the same type). Both
paths resolve ``policy="budget"`` with ``resolve_budget`` and the model's calibration profile, and the
connector holds the result to the operator's limits with ``clamp``. The lists other modules check
against (the HTTP schema's, the proxy's, the connector's) are derived from ``SPECS`` here.

Adding a policy: a ``Spec`` row here (and its selection in ``spans/recompute.py`` if it recomputes),
with its tests in ``tests/core/test_policy.py``; DEVELOPERS.md has the recipe.
Torch-free: the proxy's light install imports it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, get_args

from contextkit.core.errors import ConfigError, InputError

log = logging.getLogger(__name__)

Policy = Literal["budget", "query_attention", "kv_deviation", "first_k", "none", "full"]


@dataclass(frozen=True, slots=True)
class Spec:
    """What one policy does. ``loads``: it reuses span KV (not "full"); ``recomputes``: it recomputes part
    of it in the new context (not "none"). Every policy runs on both paths, the built-in engine and vLLM
    through the KV connector."""

    name: str
    loads: bool
    recomputes: bool


SPECS: dict[str, Spec] = {s.name: s for s in (  # in the order error messages list them
    Spec("budget", loads=True, recomputes=True),  # the calibrated default (resolve_budget)
    Spec("query_attention", loads=True, recomputes=True),
    Spec("kv_deviation", loads=True, recomputes=True),
    Spec("first_k", loads=True, recomputes=True),
    Spec("none", loads=True, recomputes=False),
    Spec("full", loads=False, recomputes=False),
)}
POLICIES: tuple[str, ...] = tuple(SPECS)
if set(POLICIES) != set(get_args(Policy)):  # the Literal is for type checkers; SPECS is the list
    raise ImportError("core.policy: the Policy literal and SPECS name different policies")
CONNECTOR_POLICIES: tuple[str, ...] = POLICIES  # what the proxy's connector path takes: every policy
REPAIR_POLICIES: tuple[str, ...] = tuple(n for n, s in SPECS.items() if s.recomputes)  # the connector's repair
# the fields of a setting the connector runs (what the wire carries); the rest run on the built-in engine
CONNECTOR_FIELDS = ("policy", "ratio", "max_recompute", "first_k", "probe_layers", "check_layer", "fidelity_budget")

# The answer KL (nats per answer token, bounded for 90% of prompts by the calibration profile:
# ``spans.calibration.upper_bound``) ``policy="budget"`` allows when the request names none. Chosen on the
# tune half of the dev file (docs/benchmarks.md, "Fidelity budget").
DEFAULT_FIDELITY_BUDGET = 0.1
DEFAULT_RATIO, DEFAULT_MAX_RECOMPUTE = 0.3, 512  # query_attention's; what policy="budget" runs with no profile
_INTS = ("first_k", "probe_layers", "check_layer")


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
        if self.policy not in SPECS:
            raise ConfigError(f"unknown recompute policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ConfigError(f"recompute ratio must be in [0, 1], got {self.ratio}")
        if self.policy == "budget" and (self.ratio, self.max_recompute) != (DEFAULT_RATIO, DEFAULT_MAX_RECOMPUTE):
            raise ConfigError(f"ratio={self.ratio}, max_recompute={self.max_recompute} with policy='budget' (the "
                              "default): the budget chooses them from the model's calibration profile; pass "
                              "policy='query_attention' (or kv_deviation) to fix a ratio yourself")
        self._check_budgets()
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

    def _check_budgets(self) -> None:
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


# -- the setting the KV connector runs ----------------------------------------------------------------
def for_connector(opts: ReuseOptions) -> ReuseOptions | None:
    """The part of a request's options the KV connector runs inside vLLM (``CONNECTOR_FIELDS``; the others
    keep their defaults); None when it recomputes nothing there ("none": load without recompute, "full":
    no span reuse)."""
    if not SPECS[opts.policy].recomputes:
        return None
    return ReuseOptions(**{k: getattr(opts, k) for k in CONNECTOR_FIELDS})


def connector_fields(opts: ReuseOptions) -> dict:
    """The connector's fields of ``opts`` as the wire carries them: a None is left out where it is the
    default; ``max_recompute: None`` (uncapped) is not the default and is kept."""
    return {k: getattr(opts, k) for k in CONNECTOR_FIELDS if getattr(opts, k) is not None or k == "max_recompute"}


def variant(opts: ReuseOptions) -> str:
    """A short name of a connector setting, for its requests' salt (``core.tenancy.pic_salt``): KV repaired
    at one setting is never a prefix hit for another."""
    canon = json.dumps(connector_fields(opts), sort_keys=True)
    return hashlib.sha256(canon.encode()).hexdigest()[:12]


def clamp(opts: ReuseOptions, *, max_ratio: float) -> tuple[ReuseOptions, dict[str, float]]:
    """``opts`` within the operator's ratio limit, and which limits applied. Raises ``ConfigError`` for a
    field of the wrong type (``ReuseOptions`` checks ranges; a setting decoded from a client's message may
    still hold a float where an int belongs): the connector then runs the request as exact reuse."""
    for name in _INTS:
        if type(getattr(opts, name)) is not int:
            raise ConfigError(f"recompute.{name} must be an integer")
    if opts.max_recompute is not None and type(opts.max_recompute) is not int:
        raise ConfigError("recompute.max_recompute must be an integer or absent")
    if type(opts.ratio) not in (int, float) or not math.isfinite(opts.ratio):
        raise ConfigError("recompute.ratio must be a number")
    if opts.ratio > max_ratio:
        return replace(opts, ratio=max_ratio), {"max_recompute_ratio": max_ratio}
    return opts, {}


# -- resolving policy="budget" -------------------------------------------------------------------------
class Chooser(Protocol):
    """A calibration profile as the budget sees it (``spans.calibration.CalibrationProfile``)."""

    id: str

    # -> spans.calibration.Choice: its ``options``, ``band`` and ``tail_gate`` are read
    def choose(self, budget: float, context_tokens: int): ...


@dataclass(frozen=True, slots=True)
class Resolved:
    """How policy="budget" was resolved for one request (both paths copy it into the request's report)."""

    options: ReuseOptions  # what runs: policy "full" when no setting is within the budget
    budget: float
    profile: str  # the profile's id, or "none": no profile, the built-in fallback ran
    band: str | None
    # the profile's tail gate for this setting: a request whose recompute moved the keys it recomputed
    # further than this (``ReuseReport.recompute_shift``) runs as a full prefill (spans.calibration)
    tail_gate: float | None = None


def resolve_budget(opts: ReuseOptions, profile: Chooser | None, tokens: int) -> Resolved:
    """policy="budget" for a ``tokens``-token prompt: the profile's cheapest setting within the budget for
    the prompt's length band (or full prefill), else, with no profile, ``ReuseOptions.fallback``. The
    request's own sinks and caps stay where the profile sets none."""
    if opts.policy != "budget":
        raise ConfigError(f"resolve_budget is for policy='budget', got {opts.policy!r}")
    if profile is None:
        return Resolved(opts.fallback(), opts.budget, "none", None)
    choice = profile.choose(opts.budget, tokens)
    c = choice.options
    chosen = replace(opts, policy=c.policy, ratio=c.ratio, max_recompute=c.max_recompute, first_k=c.first_k,
                     probe_layers=c.probe_layers, fidelity_budget=None)
    return Resolved(chosen, opts.budget, profile.id, choice.band, choice.tail_gate)


class Budgets:
    """``resolve_budget`` with one model's profile, as both paths hold it (the built-in engine's span cache
    and the connector's scheduler): without a profile it says once that the built-in default runs."""

    def __init__(self, profile: Chooser | None):
        self.profile = profile
        self._warned = False

    def resolve(self, opts: ReuseOptions, tokens: int) -> Resolved:
        if self.profile is None and not self._warned:
            self._warned = True
            log.warning("no calibration profile for this model: recompute policy 'budget' runs the built-in "
                        "default (query_attention r=%s); run `contextkit calibrate` to make one", opts.ratio)
        return resolve_budget(opts, self.profile, tokens)


# -- the count a repair recomputes ----------------------------------------------------------------------
def sinks(pieces: Sequence[tuple[int, int, int]], first_k: int) -> list[int]:
    """Prompt positions of the sinks among loaded span pieces ``(dst, n, src)``: the first ``first_k``
    tokens of each piece that starts at its span's start (``src == 0``)."""
    out: list[int] = []
    for dst, n, src in pieces:
        if src == 0 and first_k:
            out.extend(range(dst, dst + min(first_k, n)))
    return out


def planned(*, policy: str, ratio: float, max_recompute: int | None, candidates: int, sinks: int) -> int:
    """Tokens a repair recomputes besides the sinks: ``round(ratio x candidates)``, capped, at most the
    candidates that are not sinks (``first_k`` recomputes only the sinks). Fixed by the options and the
    loaded spans alone, not by what the selection finds, so that the connector's scheduler side (which
    answers the request) reports what its worker side (which recomputes) does."""
    if policy == "first_k":
        return 0
    n = math.floor(ratio * candidates + 0.5)
    if max_recompute is not None:
        n = min(n, max_recompute)
    return max(0, min(n, candidates - sinks))

