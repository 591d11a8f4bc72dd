"""``contextkit calibrate --set speeds_from=PROFILE``: re-time a profile's settings on this machine.

A profile's fidelity (each setting's answer KL per prompt, its tail gate's estimates) belongs to the model
and dtype; its speedups belong to the machine they were measured on: the fixed part of a reuse (fetch,
re-rotation, the probe) weighs differently against a full prefill on an AVX2 box in fp32 than on an AMX one
in bf16, and the order of settings can change. This keeps every fidelity number and measures only the
speedups again, per band, on ``--n`` questions (default 8): each setting's median TTFT against full
prefill's on the same prompts, as calibrate measures them, no answers generated. The profile is written
with this machine (``core.config.machine_class``), to ``--set out=`` or over the profile beside the model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from contextkit.bench.bands import choose_questions
from contextkit.bench.calibrate import span_kv
from contextkit.bench.data import load_records, shared_half, split
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, time_ms
from contextkit.core.config import machine_class
from contextkit.core.models import resolve_model_dir
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import Planner
from contextkit.core.policy import ReuseOptions
from contextkit.core.tokenizer import Tokenizer
from contextkit.engine.model import Engine
from contextkit.spans.assemble import SpanCache
from contextkit.spans.calibration import Band, CalibrationProfile, profile_path


def _timed(cache: SpanCache, plan: RequestPlan, options: ReuseOptions, provided: dict) -> float:
    return time_ms(lambda: cache.assemble(dataclasses.replace(plan, options=options), extra_capacity=1,
                                          provided=provided), 1)[0]


def _band(profile: CalibrationProfile, band: Band, chosen: list, cache: SpanCache, tick: Tick) -> Band:
    full_ms: list[float] = []
    ms: dict[int, list[float]] = {i: [] for i in range(len(band.points))}
    for qi, (_, plan) in enumerate(chosen):
        tick(f"{band.name} q{qi}")
        provided = span_kv(cache, plan, profile.kv_source)  # the profile's KV source, ahead, as calibrate does
        full_ms.append(_timed(cache, plan, ReuseOptions(policy="full"), {}))
        for i, point in enumerate(band.points):
            ms[i].append(_timed(cache, plan, profile.options(point), provided))
    full = median(full_ms)
    points = tuple(dataclasses.replace(p, speedup=round(full / median(ms[i]), 3)) for i, p in enumerate(band.points))
    return dataclasses.replace(band, points=points)


def retime(ctx: BenchContext, tick: Tick, source: Path) -> BenchResult:
    """Re-measure ``source``'s speedups here (module docstring); rows: each setting's speedup before and here."""
    dtype = ctx.config.dtype
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    tok = Tokenizer(model_dir)
    engine = Engine.from_dir(model_dir, dtype)
    old = CalibrationProfile.load(source, model_digest=engine.fingerprint.digest, dtype=dtype)
    cache = SpanCache(engine, tokenizer_fingerprint=tok.fingerprint)
    planner = Planner(tok, context_limit=engine.spec.max_positions)
    part = ctx.option("split", shared_half(ctx.data, "tune"))
    records = split(load_records(ctx.data), part)
    n = ctx.count(8)
    work = {b.name: choose_questions(planner, records, b.name, decode=1, count=n, seed=ctx.seed) for b in old.bands}
    tick(total=sum(len(c) for c in work.values()))
    bands = tuple(_band(old, b, work[b.name], cache, tick) if work[b.name] else b for b in old.bands)
    new = dataclasses.replace(old, bands=bands, machine=machine_class())
    out = Path(ctx.option("out", str(profile_path(model_dir, dtype, old.kv_source))))
    out.write_text(new.to_json())
    rows: list[dict[str, Any]] = [
        {"band": b.name, "probe_layers": old.probe_depth(p), "ratio": p.ratio,
         "first_k": p.first_k, "speedup_before": p.speedup,
         "speedup_here": q.speedup}
        for ob, b in zip(old.bands, new.bands) for p, q in zip(ob.points, b.points)]
    summary = {"machine_before": old.machine or "not recorded", "machine": new.machine,
               "bands_retimed": [b for b, c in work.items() if c], "questions_per_band": n}
    return BenchResult("calibrate", {"model": ctx.config.model, "dtype": dtype, "speeds_from": str(source),
                                     "split": part, "n": n, "profile": str(out)}, rows, summary)
