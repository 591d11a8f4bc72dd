"""The compared configurations of ``contextkit bench spans`` (its methods table), and ``--set methods=`` to
run part of it. Split from ``contextkit.bench.spans`` to keep that module short."""

from __future__ import annotations

import dataclasses

from contextkit.bench.calibrate import BUDGETS
from contextkit.core.errors import ConfigError
from contextkit.core.policy import ReuseOptions

REFERENCE = "full"  # float32 full prefill: what every row's fidelity is measured against


@dataclasses.dataclass(frozen=True, slots=True)
class Method:
    options: ReuseOptions
    dtype: str  # the engine it runs on


def methods(dtype: str, band: str, first_k: int) -> dict[str, Method]:
    """The compared configurations for a band; the long bands run a shorter list (their prefill is slow).

    ``dtype`` is the engine of the reuse rows (the config's); "full" always runs on float32. Ratio rows
    other than the fallback's are uncapped (``max_recompute=None``), so "r=0.5" recomputes half. The
    default is a fidelity budget (policy "budget"), resolved per prompt by the engine's calibration profile;
    "budget b" rows are the other budgets; the fallback row is what a budget runs with no profile.
    """
    default = ReuseOptions()
    fallback = default.fallback()
    cap = fallback.max_recompute
    out = {REFERENCE: Method(ReuseOptions(policy="full"), "float32")}
    if dtype != "float32":
        out[f"full ({dtype})"] = Method(ReuseOptions(policy="full"), dtype)
    out["reuse"] = Method(ReuseOptions(policy="none", first_k=0), dtype)
    out[f"default (budget {default.budget})"] = Method(default, dtype)
    for b in BUDGETS:
        if b != default.budget:
            out[f"budget {b}"] = Method(ReuseOptions(fidelity_budget=b), dtype)
    out[f"query_attention r={fallback.ratio}, <={cap}"] = Method(fallback, dtype)
    for r in (0.1, 0.5) if band == "1.5k" else (0.1,):
        out[f"query_attention r={r}"] = Method(dataclasses.replace(fallback, ratio=r, max_recompute=None), dtype)
    if band == "1.5k":
        out[f"first_k k={first_k}"] = Method(ReuseOptions(policy="first_k", first_k=first_k), dtype)
        out["kv_deviation r=0.3"] = Method(ReuseOptions(policy="kv_deviation", ratio=0.3, first_k=0,
                                                        max_recompute=cap), dtype)
        out["all-layer probe r=0.3"] = Method(dataclasses.replace(fallback, probe_layers=0), dtype)
        out["attention_budget=0.2"] = Method(dataclasses.replace(fallback, attention_budget=0.2), dtype)
        if dtype != "float32":
            out["default (float32)"] = Method(default, "float32")
    return out


def default_method(table: dict[str, Method], dtype: str) -> str:
    """The row that runs the library's default ReuseOptions on the configured engine."""
    d = ReuseOptions()
    for name, m in table.items():
        if m.options == d and m.dtype == dtype:
            return name
    raise AssertionError("the default ReuseOptions must be one of the bench's methods")


def same_dtype_full(table: dict[str, Method], dtype: str) -> str:
    """The full-prefill row on the methods' engine (the float32 reference when they run float32)."""
    return next((n for n, m in table.items() if m.options.policy == "full" and m.dtype == dtype), REFERENCE)


def selected(table: dict[str, Method], dtype: str, names: str | None) -> dict[str, Method]:
    """``--set methods=a,b``: the rows whose names start with ``a`` or ``b`` (``budget`` takes every budget
    row), plus the rows the summary is built on (both full prefills, the default, ``reuse``); None: all.
    A name that starts no method of any band is refused with the methods' names."""
    if not names:
        return table
    want = [w.strip() for w in names.split(",") if w.strip()]
    every = methods(dtype, "1.5k", 8)  # the longest list: a long band runs part of it
    unknown = [w for w in want if not any(n.startswith(w) for n in every)]
    if unknown:
        raise ConfigError(f"--set methods=: no method starts with {', '.join(unknown)}; the methods: "
                          f"{', '.join(every)}")
    keep = {REFERENCE, same_dtype_full(table, dtype), default_method(table, dtype), "reuse"}
    return {n: m for n, m in table.items() if n in keep or any(n.startswith(w) for w in want)}
