"""``contextkit bench rope``: re-rotating a span's keys over all layers, per kernel path.

The span is 2048 tokens of the default model's keys (layers x kv_heads x tokens x head_dim). Each path
moves it by one offset, the way a span is laid into a cache:

- ``reference``: the torch reference, out of place.
- ``cpu (rotate-copy)``: the fused C kernel rotating from the stored span into a slice of a larger
  cache (what assembly does: it replaces the copy it would do anyway).
- ``cpu (in place)``: the fused kernel rotating a buffer in place.
- ``copy``: a plain ``Tensor.copy_`` of the same bytes into the same cache slice, the bandwidth floor.

``rerotate_vs_copy`` = rotate-copy time / copy time; ``rerotate_fraction_of_prefill`` = rotate-copy
time / the engine's prefill time of the same 2048 tokens, measured in the same run.
"""

from __future__ import annotations

from typing import Any

import torch

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, time_ms, timing_stats
from contextkit.core.models import resolve_model_dir
from contextkit.engine.model import Engine, parse_dtype
from contextkit.kernels.rerotate import Rerotator, rerotate_reference
from contextkit.kernels.rope import rope


def _times(fn, reps: int) -> list[float]:
    return time_ms(fn, reps, warmup=1)  # warm up: first touch, kernel build


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    tokens = ctx.option("tokens", 2048, int)
    reps = ctx.option("reps", 20, int)
    dtypes = ctx.option("dtypes", ("float32", "bfloat16"), lambda s: tuple(s.split(",")))
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    engine = Engine.from_dir(model_dir, "float32")
    spec = engine.spec
    rope_spec = spec.layers[0].rope
    tick(total=len(dtypes) * 4 + 1)
    g = torch.Generator().manual_seed(ctx.seed)
    ids = torch.randint(0, spec.vocab_size, (tokens,), generator=g)

    tick("prefill")
    prefill_ms = median(_times(lambda: engine.forward(engine.new_cache(tokens), ids), max(ctx.count(3), 1)))
    rerotator = Rerotator("cpu")
    rows: list[dict[str, Any]] = []
    for dt in dtypes:
        dtype = parse_dtype(dt)
        raw = torch.randn(spec.num_layers, spec.num_kv_heads, tokens, spec.head_dim, generator=g, dtype=torch.float64)
        span = rope(raw, torch.arange(tokens), rope_spec).to(dtype)  # as stored: rotated from position 0
        cache = torch.zeros(spec.num_layers, spec.num_kv_heads, tokens + 512, spec.head_dim, dtype=dtype)
        dst = cache[:, :, 256 : 256 + tokens]
        buf = span.clone()
        nbytes = span.numel() * span.element_size()
        paths = {
            "copy": lambda: dst.copy_(span),
            "cpu (rotate-copy)": lambda: rerotator(span, 900, rope_spec, out=dst),
            "cpu (in place)": lambda: rerotator(buf, 900, rope_spec, out=buf),
            "reference": lambda: rerotate_reference(span, 900, rope_spec),
        }
        times = {}
        for name, fn in paths.items():
            tick(f"{name} {dt}")
            times[name] = _times(fn, reps if name != "reference" else max(3, reps // 4))
        copy_ms = median(times["copy"])
        for name, ts in times.items():
            ms = median(ts)
            rows.append({
                "path": name,
                "dtype": dt,
                "tokens": tokens,
                "mbytes": round(nbytes / 1e6, 1),
                **timing_stats("ms", ts),
                "gbytes_per_s": round(nbytes / (ms / 1e3) / 1e9, 2),
                "vs_copy": round(ms / copy_ms, 3),
                "fraction_of_prefill": round(ms / prefill_ms, 5),
                "default": name == "cpu (rotate-copy)" and dt == "float32",
            })
    triton_row = {"path": "triton", "dtype": "-", "tokens": tokens,
                  "note": "GPU only; CPU tests run it in the interpreter"}
    rows.append(triton_row)
    best = next(r for r in rows if r.get("default"))
    summary = {
        "reps": reps,
        "rerotate_vs_copy": best["vs_copy"],
        "rerotate_fraction_of_prefill": best["fraction_of_prefill"],
        "rerotate_ms_p50": best["ms_p50"],
        "copy_ms_p50": next(r["ms_p50"] for r in rows if r["path"] == "copy" and r["dtype"] == "float32"),
        "prefill_ms_p50": round(prefill_ms, 1),
        "reference_vs_copy": next(r["vs_copy"] for r in rows if r["path"] == "reference" and r["dtype"] == "float32"),
    }
    config = {"model": ctx.config.model, "tokens": tokens, "reps": reps, "dtypes": list(dtypes),
              "layers": spec.num_layers, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
              "fallbacks": dict(rerotator.fallbacks)}
    return BenchResult("rope", config, rows, summary)


def plot(result: BenchResult, path) -> None:
    import matplotlib.pyplot as plt

    rs = [r for r in result.rows if "ms_p50" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['path']}\n{r['dtype']}" for r in rs]
    ax.bar(range(len(rs)), [r["ms_p50"] for r in rs])
    ax.set_xticks(range(len(rs)), labels, fontsize=7, rotation=30, ha="right")
    ax.set(ylabel="ms (p50)", title=f"re-rotating {rs[0]['tokens']} tokens x all layers", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
