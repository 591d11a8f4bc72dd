"""``contextkit calibrate``: measure what each recompute setting does to a model's answers, per length band, and write
the profile that resolves ``ReuseOptions(policy="budget")`` (``contextkit.spans.calibration``).

On the tune half of ``--data`` (the shared dev file by default; ``--set split=`` to change), per band (``--set
bands=0.25k,1.5k,3k,4k``) ``--n`` questions (default 24) rendered to that band, each question's passages compiled as
spans first. Per question: full prefill on the engine (the configured dtype) and its greedy answer (``--set
answer_tokens=32``) are the reference; then for each query_attention ratio (``--set
ratios=0,0.05,0.1,0.2,0.3,0.5,0.7``, uncapped, with the library's first-k sinks) and each probe depth (``--set
probe_layers=8,0``: through the first 8 layers, and through all), and for first_k alone at each k (``--set
first_k=16,32,48,64,96``: EPIC's LegoLink, the first k tokens of each reused span recomputed, no probe; ``--set
first_k=`` for none), and for kv_deviation at each ratio (``--set kv_deviation=0.1,0.2,0.3``: CacheBlend's
selection), the assembled KV's answer KL and teacher-forced agreement over that answer
(``spans.fidelity``), and its TTFT. A budget chooses the fastest setting within it (``CalibrationProfile.choose``),
so a deeper probe is taken where it reaches the budget at a ratio low enough to pay for itself, and first_k where it
reaches the budget faster than any probe. The profile keeps the per-prompt numbers; a budget is later held to their
``spans.calibration.upper_bound`` at ``--set quantile=0.9``: the ceil((n+1)q)-th smallest of n, so more prompts give
a tighter bound, and fewer than q/(1-q) (9 at 0.9) bound nothing and are refused. The profile records the machine
its speedups were measured on; ``--set speeds_from=PROFILE`` re-times an existing profile's settings on this one,
keeping its fidelity (``bench.calibrate_speeds``). ``--set add_to=PROFILE`` adds the bands measured to an existing
profile of the same weights, dtype, settings and machine class (a band of the same name is replaced): a new band
without measuring the others again. Written beside the model (``contextkit-calibration-<dtype>.json``) or to ``--set
out=PATH``.

``--set kv_source=``: the reused KV measured. ``compiled`` (the default): each passage compiled alone, as the
built-in engine's span store holds it. ``context``: each passage cut out of a prefill of the same prompt with
its passages in reverse order (``spans.compile.cut_from_context``), as vLLM's connector saves spans out of the
first request that held them and loads them into the next (``context_spans``); its profile is
``contextkit-calibration-<dtype>-context.json``, the one the connector resolves budgets with. Its default
series are query_attention's ratios and kv_deviation's (no first_k: those spans' starts are not the
sinks it repairs); compiled's: query_attention's and first_k's.

Rows: one per band and setting (probe depth and ratio, or first_k's k; answer KL p50/p90 and ``answer_kl_bound``,
the bound a budget is held to; tf_agreement; speedup vs full prefill in the same run); summary: per band, the
policy, ratio, probe depth, k and tail gate each budget in ``BUDGETS`` (also ``bench spans``' budget rows) would
choose, and its expected speedup (the gate's full prefills counted). Per row, the recompute's key shift per prompt
(``Point.shift``) against the answer KL: ``shift_kl_rank_corr``, whether the shift can tell the tail (the gate's
premise).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextkit.bench.answers import answered
from contextkit.bench.bands import band_key, choose_questions, parse_bands
from contextkit.bench.data import SHARED_MULTIHOP, load_records, shared_half, split
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.core.config import machine_class
from contextkit.core.errors import ConfigError, InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.models import resolve_model_dir
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import Planner
from contextkit.core.policy import ReuseOptions
from contextkit.core.tokenizer import Tokenizer
from contextkit.engine.model import Engine
from contextkit.spans.assemble import SpanCache
from contextkit.spans.calibration import (
    KV_SOURCES,
    Band,
    CalibrationProfile,
    Point,
    minimum_prompts,
    profile_path,
    upper_bound,
)
from contextkit.spans.compile import cut_from_context
from contextkit.spans.fidelity import compare, reference_answer
from contextkit.spans.store import CompiledSpan

RATIOS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
PROBES = (8, 0)  # probe depths: the first 8 layers (ReuseOptions' default), and all (0)
# first_k alone (LegoLink): on Qwen2.5-0.5B bf16 at 1.5k (tune half, 2026-12-06) k=32 reached r=0.2's answer
# KL p90 at 3.5x instead of 3.0x and k=64 r=0.3's speed at a lower KL (docs/benchmarks.md, "Per-span first-k")
FIRST_KS = (16, 32, 48, 64, 96)
DEVIATIONS = (0.1, 0.2, 0.3, 0.5)  # kv_deviation's ratios (the context source's default series)
BUDGETS = (0.02, 0.05, 0.1)  # the budgets the summary shows choices for (bench spans measures the same)


def _listed(name: str, text: str | None, default: tuple, parse, ok, hint: str, *, ordered: bool = False,
            empty_ok: bool = False) -> tuple:
    """``--set name=a,b,...``: the values, unique (sorted, or in the order given where ``ordered``), each
    ``ok``; ``default`` where not set; a ``ConfigError`` that says what to give otherwise."""
    if text is None:
        return default
    try:
        seen = dict.fromkeys(parse(x) for x in text.split(",") if x.strip())
    except ValueError:
        seen = None
    if seen is None or (not seen and not empty_ok) or not all(ok(v) for v in seen):
        raise ConfigError(f"--set {name}={text!r}: give {hint}")
    return tuple(seen) if ordered else tuple(sorted(seen))


def _probes(text: str | None) -> tuple[int, ...]:  # the first depth also measures ratio 0 (no probe)
    return _listed("probe_layers", text, PROBES, int, lambda d: d >= 0,
                   "comma-separated layer counts >= 0 (0: all layers)", ordered=True)


def _first_ks(text: str | None) -> tuple[int, ...]:
    return _listed("first_k", text, FIRST_KS, int, lambda k: k >= 1,
                   "comma-separated token counts >= 1 (empty: no first_k series)", empty_ok=True)


def _ratios(text: str | None) -> tuple[float, ...]:
    return _listed("ratios", text, RATIOS, float, lambda r: 0 <= r <= 1, "comma-separated numbers in [0, 1]")


def _deviations(text: str | None, kv_source: str) -> tuple[float, ...]:
    return _listed("kv_deviation", text, DEVIATIONS if kv_source == "context" else (), float, lambda r: 0 < r <= 1,
                   "comma-separated ratios in (0, 1] (empty: no kv_deviation series)", empty_ok=True)


def _source(text: str | None) -> str:
    if text is None or text in KV_SOURCES:
        return text or "compiled"
    raise ConfigError(f"--set kv_source={text!r}: give one of {', '.join(KV_SOURCES)}")


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting calibrate measures: query_attention at ``ratio`` through ``probe_layers`` layers; with
    ``first_k``, first_k alone (``Point.first_k``); or kv_deviation at ``ratio`` (``policy``)."""

    probe_layers: int | None
    ratio: float
    first_k: int | None = None
    policy: str = "query_attention"

    def point(self, answer_kl: tuple[float, ...] = (), tf_agreement: tuple[float, ...] = (), speedup: float = 1.0,
              shift: tuple[float, ...] = ()) -> Point:
        return Point(self.ratio, answer_kl, tf_agreement, speedup, self.probe_layers, shift, self.first_k,
                     self.policy)


def _settings(probes: tuple[int, ...], ratios: tuple[float, ...], ks: tuple[int, ...],
              deviations: tuple[float, ...] = ()) -> tuple[Setting, ...]:
    """Every query_attention (depth, ratio), ratio 0 once (it runs no probe: under the first depth), then
    first_k at each k, then kv_deviation at each ratio."""
    qa = tuple(Setting(d, r) for d in probes for r in ratios if r > 0 or d == probes[0])
    return (qa + tuple(Setting(None, 0.0, k, "first_k") for k in ks)
            + tuple(Setting(None, r, None, "kv_deviation") for r in deviations))


def span_kv(cache: SpanCache, plan: RequestPlan, kv_source: str) -> dict[int, CompiledSpan]:
    """The reused KV a question is measured with, as ``SpanCache.assemble``'s ``provided``: none for
    "compiled" (its spans compiled alone into the store now, where the assembly finds them), else each
    passage cut from a prefill of the prompt with its passages in reverse order (the rest in place)."""
    items = plan.items[:-1]
    if kv_source == "compiled":
        for it in items:
            cache.compiled(it.span)
        return {}
    docs = [i for i, it in enumerate(items) if it.span.kind == "document"]
    order = list(range(len(items)))
    for at, i in zip(docs, reversed(docs)):
        order[at] = i
    cut = cut_from_context(cache.engine, cache.identity, [items[i].span for i in order], cache.rerotator)
    return {i: kv for i, kv in zip(order, cut) if items[i].reuse}


Measured = tuple[float, float, float, float | None]  # answer KL, tf_agreement, TTFT, the recompute's key shift


def _question(cache: SpanCache, tok: Tokenizer, plan: RequestPlan, shell: CalibrationProfile,
              settings: tuple[Setting, ...], answer_tokens: int) -> tuple[float, dict[Setting, Measured]]:
    """One question: full prefill's TTFT, and per setting (answer KL, tf_agreement, TTFT, the recompute's
    key shift: the tail gate's signal) against it, on the profile's KV source."""
    provided = span_kv(cache, plan, shell.kv_source)
    engine = cache.engine
    t0 = time.perf_counter()
    full = cache.assemble(dataclasses.replace(plan, options=ReuseOptions(policy="full")),
                          extra_capacity=answer_tokens + 1)
    full_ms = (time.perf_counter() - t0) * 1e3
    kv, _ = answered(engine, tok, plan.ids, full.cache, full.logits, SamplingParams(max_new_tokens=answer_tokens))
    ref = reference_answer(engine, kv.cache, kv.first_logits, kv.token_ids, stopped=kv.stopped)
    out = {}
    for s in settings:
        opts = shell.options(s.point())  # what a request runs when the profile chooses this setting
        t0 = time.perf_counter()
        asm = cache.assemble(dataclasses.replace(plan, options=opts), extra_capacity=len(ref.targets) + 1,
                             provided=provided)
        ms = (time.perf_counter() - t0) * 1e3
        f = compare(ref, engine, asm.cache, asm.logits)
        out[s] = (f.answer_kl, f.tf_agreement, ms, asm.report.recompute_shift)
    return full_ms, out


def _band(name: str, chosen: list[tuple[Any, RequestPlan]], cache: SpanCache, tok: Tokenizer,
          shell: CalibrationProfile, settings: tuple[Setting, ...], answer_tokens: int, tick: Tick) -> Band:
    full_ms: list[float] = []
    per: dict[Setting, list[Measured]] = {s: [] for s in settings}
    for qi, (_, plan) in enumerate(chosen):
        tick(f"{name} q{qi}")
        ms, measured = _question(cache, tok, plan, shell, settings, answer_tokens)
        full_ms.append(ms)
        for s, m in measured.items():
            per[s].append(m)
    full = median(full_ms)
    points = tuple(s.point(tuple(round(m[0], 6) for m in per[s]), tuple(round(m[1], 4) for m in per[s]),
                           round(full / median([m[2] for m in per[s]]), 3), _shifts([m[3] for m in per[s]]))
                   for s in settings)
    return Band(name, int(median([p.num_tokens for _, p in chosen])), points)


def _shifts(values: list[float | None]) -> tuple[float, ...]:
    """Per prompt, the recompute's key shift (empty when a prompt recomputed nothing)."""
    return () if any(v is None for v in values) else tuple(round(v, 6) for v in values)


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    source = ctx.option("speeds_from", None)
    if source is not None:  # keep a profile's fidelity, re-time its settings on this machine
        from contextkit.bench.calibrate_speeds import retime

        return retime(ctx, tick, Path(source))
    bands = parse_bands(ctx.option("bands", "0.25k,1.5k,3k,4k"))
    ratios = _ratios(ctx.option("ratios", None))
    probes = _probes(ctx.option("probe_layers", None))
    kv_source = _source(ctx.option("kv_source", None))
    ks = _first_ks(ctx.option("first_k", None) if kv_source == "compiled" else ctx.option("first_k", ""))
    deviations = _deviations(ctx.option("kv_deviation", None), kv_source)
    settings = _settings(probes, ratios, ks, deviations)
    answer_tokens = ctx.option("answer_tokens", 32, int)
    q = ctx.option("quantile", 0.9, float)
    if not 0 < q < 1 or answer_tokens < 1:
        raise ConfigError("--set quantile must be in (0, 1) and answer_tokens >= 1")
    n, least = ctx.count(24), minimum_prompts(q)
    if n < least:
        raise ConfigError(f"--n {n}: at quantile {q} a band needs at least {least} prompts to bound "
                          f"anything (the profile would choose full prefill everywhere); give --n 24 or more, or "
                          f"a lower --set quantile=")
    if ctx.data is None and not SHARED_MULTIHOP.is_file():  # the bundled example is one question: no profile
        raise InputError("calibrate needs questions with their passages: pass --data FILE (JSONL, one "
                         '{"question", "answers", "passages": [{"text"}]} a line, the shape of multihop_dev.jsonl); '
                         f"without --data it reads {SHARED_MULTIHOP}, which is here only in a checkout beside "
                         "the shared data", "data")
    part = ctx.option("split", shared_half(ctx.data, "tune"))
    dtype = ctx.config.dtype
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, dtype)
    cache = SpanCache(engine, tokenizer_fingerprint=tok.fingerprint)
    planner = Planner(tok, context_limit=engine.spec.max_positions)
    records = split(load_records(ctx.data), part)
    work = {b: choose_questions(planner, records, b, decode=answer_tokens, count=n, seed=ctx.seed) for b in bands}
    if few := [f"{b} ({len(c)})" for b, c in work.items() if len(c) < least]:
        raise InputError(f"too few questions of the data render to the band(s) {', '.join(few)} to bound a "
                         f"{q} quantile (at least {least} each); give more data or choose other "
                         f"--set bands=")
    shell = CalibrationProfile(
        model_digest=engine.fingerprint.digest, dtype=dtype, quantile=q, answer_tokens=answer_tokens,
        data=f"{ctx.data or SHARED_MULTIHOP.name} ({part}, n={n} per band, seed {ctx.seed})", bands=(),
        first_k=ReuseOptions().first_k, probe_layers=ReuseOptions().probe_layers, machine=machine_class(),
        kv_source=kv_source)
    base = _base(ctx.option("add_to", None), shell)
    tick(total=sum(len(c) for c in work.values()))
    fitted = tuple(_band(b, c, cache, tok, shell, settings, answer_tokens, tick) for b, c in work.items())
    profile = _merged(base, dataclasses.replace(shell, bands=fitted))
    out = Path(ctx.option("out", str(profile_path(model_dir, dtype, kv_source))))
    out.write_text(profile.to_json())
    return BenchResult("calibrate", {"model": ctx.config.model, "dtype": dtype, "split": part, "n": n,
                                     "kv_source": kv_source, "ratios": ratios, "probe_layers": probes,
                                     "first_k": ks, "kv_deviation": deviations, "quantile": q,
                                     "answer_tokens": answer_tokens, "profile": str(out)},
                       _rows(profile), _summary(profile, n))


def _merged(base: CalibrationProfile | None, new: CalibrationProfile) -> CalibrationProfile:
    """``new``'s bands added to ``base`` (one of the same name replaced), bands by length (``_base`` checked
    that the two agree on everything but their bands and data)."""
    if base is None:
        return new
    names = {b.name for b in new.bands}
    bands = sorted((*(b for b in base.bands if b.name not in names), *new.bands), key=lambda b: b.context_tokens)
    data = f"{base.data}; bands {', '.join(sorted(names))}: {new.data}"
    return dataclasses.replace(base, bands=tuple(bands), data=data)


def _base(path: str | None, want: CalibrationProfile) -> CalibrationProfile | None:
    """The profile ``--set add_to`` names, before anything is measured: refused unless it was made for these
    weights and dtype with the same settings on a machine of this class (else the merged profile would mix
    numbers that do not compare)."""
    if path is None:
        return None
    old = CalibrationProfile.load(path, model_digest=want.model_digest, dtype=want.dtype)
    fields = ("quantile", "answer_tokens", "first_k", "probe_layers", "machine", "kv_source")
    differ = [f"{f} {getattr(old, f)!r} vs {getattr(want, f)!r}" for f in fields if getattr(old, f) != getattr(want, f)]
    if differ:
        raise ConfigError(f"--set add_to={path}: that profile was measured otherwise ({'; '.join(differ)}); "
                          "calibrate with its settings on a machine of its class, or write a new profile")
    return old


def _rows(profile: CalibrationProfile) -> list[dict[str, Any]]:
    return [{"band": b.name, "context_tokens": b.context_tokens, "policy": profile.options(p).policy,
             "probe_layers": profile.probe_depth(p), "ratio": p.ratio,
             "first_k": p.first_k,
             "answer_kl_p50": round(median(p.answer_kl), 4), "answer_kl_p90": round(percentile(p.answer_kl, 90), 4),
             "answer_kl_bound": round(upper_bound(p.answer_kl, profile.quantile), 4),  # what choose() compares
             "tf_agreement": round(sum(p.tf_agreement) / len(p.tf_agreement), 3), "speedup_vs_full": p.speedup,
             # does the recompute's key shift track the answer KL (the tail gate's premise)? Spearman's rho
             "shift_p50": round(median(p.shift), 4) if p.shift else None,
             "shift_kl_rank_corr": _rank_corr(p.shift, p.answer_kl) if p.shift else None}
            for b in profile.bands for p in b.points]


def _rank_corr(x: tuple[float, ...], y: tuple[float, ...]) -> float | None:
    """Spearman's rank correlation (ties share their mean rank); None when either side is constant.
    (statistics.correlation's method="ranked" is Python 3.12; this is 3.11.)"""
    def ranks(v: tuple[float, ...]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(x), ranks(y)
    try:
        return round(statistics.correlation(rx, ry), 3)
    except statistics.StatisticsError:
        return None


def _summary(profile: CalibrationProfile, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"prompts": n * len(profile.bands), "profile": profile.id}
    for b in profile.bands:
        for budget in BUDGETS:
            c = profile.choose(budget, b.context_tokens)
            full = c.options.policy == "full"
            qa = c.options.policy == "query_attention"
            out[band_key(f"policy_at_{budget}", b.name)] = c.options.policy
            out[band_key(f"ratio_at_{budget}", b.name)] = "full" if full else c.options.ratio
            out[band_key(f"probe_layers_at_{budget}", b.name)] = c.options.probe_layers if qa else None
            out[band_key(f"first_k_at_{budget}", b.name)] = c.options.first_k if c.options.policy == "first_k" else None
            out[band_key(f"gate_at_{budget}", b.name)] = c.tail_gate  # the tail gate (None: none)
            out[band_key(f"expected_speedup_at_{budget}", b.name)] = 1.0 if full else c.expected_speedup
    return out
