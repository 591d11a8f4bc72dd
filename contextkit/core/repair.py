"""What a span-reuse request through the vLLM connector recomputes: ``RepairOptions``, on both sides.

The proxy turns a documents request's ``contextkit.reuse`` into these options and sends them in
``kv_transfer_params.contextkit.recompute``; the connector (``integrations/vllm_connector``) parses them
back with ``RepairOptions.of``, resolves ``budget`` with the model's calibration profile on its scheduler
side, and its worker repairs the loaded span KV before vLLM's forward reads it (``repair.py`` there).
Torch-free: the proxy's light install imports it.

The number of tokens a request recomputes is fixed by the options and the loaded spans alone
(``planned``), not by what the selection finds, so that the scheduler side (which answers the request)
reports what the worker side (which recomputes) does: the first ``first_k`` tokens of each loaded span
that starts there (the attention sinks a span compiled alone has and its new place lacks), plus
``round(ratio x candidates)`` more (at most ``max_recompute``), chosen by the policy among the others.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.plan import DEFAULT_MAX_RECOMPUTE, DEFAULT_RATIO, ReuseOptions

REPAIR_POLICIES = ("budget", "query_attention", "kv_deviation", "first_k")
_FIELDS = ("policy", "ratio", "max_recompute", "first_k", "probe_layers", "check_layer", "fidelity_budget",
           "probe_end")


@dataclass(frozen=True, slots=True)
class RepairOptions:
    """One request's recompute inside vLLM (field meanings as ``core.plan.ReuseOptions``).

    Attributes:
        policy: "budget" (the calibrated default: resolved per request from the model's profile, else
            query_attention with the fields below), "query_attention", "kv_deviation" or "first_k".
        probe_end: the prompt token where the selection's view of the question ends (None: the prompt's
            end). Benchmarks feeding a reference answer back set it so that the answer never steers which
            tokens are recomputed.
    """

    policy: str = "budget"
    ratio: float = DEFAULT_RATIO
    max_recompute: int | None = DEFAULT_MAX_RECOMPUTE
    first_k: int = 2
    probe_layers: int = 8
    check_layer: int = 1
    fidelity_budget: float | None = None
    probe_end: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in REPAIR_POLICIES:
            raise ConfigError(f"recompute policy {self.policy!r} does not run inside vLLM; choose one of "
                              f"{', '.join(REPAIR_POLICIES)} (or none / full)")
        if self.probe_end is not None and self.probe_end < 1:
            raise ConfigError(f"recompute.probe_end must be >= 1, got {self.probe_end}")
        try:
            self.reuse()  # ReuseOptions checks the rest (ranges, the budget's interval)
        except InputError as exc:  # the connector runs such a request as exact reuse: one error type there
            raise ConfigError(str(exc)) from None

    def reuse(self) -> ReuseOptions:
        """The same setting as the built-in engine's options (for ``spans.recompute.select``)."""
        return ReuseOptions(policy=self.policy, ratio=self.ratio, max_recompute=self.max_recompute,
                            first_k=self.first_k, probe_layers=self.probe_layers, check_layer=self.check_layer,
                            fidelity_budget=self.fidelity_budget)

    @classmethod
    def of(cls, raw: Any) -> RepairOptions:
        """Parse ``kv_transfer_params.contextkit.recompute``; ``ConfigError`` says what is wrong."""
        if not isinstance(raw, Mapping):
            raise ConfigError("kv_transfer_params.contextkit.recompute must be an object")
        unknown = set(raw) - set(_FIELDS)
        if unknown:
            raise ConfigError(f"kv_transfer_params.contextkit.recompute: unknown fields {sorted(unknown)}; "
                              f"known: {', '.join(_FIELDS)}")
        try:
            return cls(**{k: raw[k] for k in _FIELDS if k in raw})
        except TypeError as exc:
            raise ConfigError(f"kv_transfer_params.contextkit.recompute: {exc}") from None

    @classmethod
    def from_reuse(cls, opts: ReuseOptions) -> RepairOptions | None:
        """The proxy's mapping of a request's ``contextkit.reuse``; None for "none" (load without recompute)
        and "full" (no span reuse)."""
        if opts.policy in ("none", "full"):
            return None
        return cls(policy=opts.policy, ratio=opts.ratio, max_recompute=opts.max_recompute, first_k=opts.first_k,
                   probe_layers=opts.probe_layers, check_layer=opts.check_layer,
                   fidelity_budget=opts.fidelity_budget)

    def wire(self) -> dict[str, Any]:
        """The options as ``kv_transfer_params`` carry them (``integrations/vllm_connector/wire.py``). A None
        is left out where it is the default; ``max_recompute: None`` (uncapped) is not the default and is
        sent as it is (left out, the connector read it as the default cap and the request's salt variant
        no longer matched: such requests ran as exact reuse)."""
        return {k: v for k, v in asdict(self).items() if v is not None or k == "max_recompute"}

    @property
    def variant(self) -> str:
        """A short name of the setting, for the request's salt (``core.tenancy.pic_salt``)."""
        canon = json.dumps({k: v for k, v in self.wire().items() if k != "probe_end"}, sort_keys=True)
        return hashlib.sha256(canon.encode()).hexdigest()[:12]


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
    candidates that are not sinks (``first_k`` recomputes only the sinks)."""
    if policy == "first_k":
        return 0
    n = math.floor(ratio * candidates + 0.5)
    if max_recompute is not None:
        n = min(n, max_recompute)
    return max(0, min(n, candidates - sinks))
