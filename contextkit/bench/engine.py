"""``contextkit bench engine``: built-in engine vs transformers, prefill and decode, fp32 and bf16.

Prompts are real: each question's system prompt + passages + question through the chat template,
concatenated over questions until the target length, then cut to exactly that many tokens. Both
implementations see the same token ids in the same run, in alternating order, and return only the
last position's logits (transformers: ``logits_to_keep=1``, its fastest prefill). The transformers
baseline uses its default attention (SDPA); one extra fp32 row uses ``attn_implementation="eager"``.

Decode is timed as ``decode_tokens`` single-token steps after a prefill of each length.
Fidelity of bf16 is the next-token KL(fp32 || bf16) and top-1 agreement of the engine in both dtypes.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from contextkit.bench.data import load_records, sample
from contextkit.bench.harness import (
    BenchContext,
    BenchResult,
    Tick,
    median,
    timing_stats,
)
from contextkit.bench.metrics import kl_divergence
from contextkit.core.models import resolve_model_dir
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.tokenizer import Tokenizer
from contextkit.engine.model import Engine, parse_dtype


def _prompts(ctx: BenchContext, tokenizer: Tokenizer, length: int, count: int) -> list[list[int]]:
    records = load_records(ctx.data)
    planner = Planner(tokenizer)
    out = []
    for i in range(count):
        ids: list[int] = []
        for rec in sample(records, len(records), ctx.seed + 1000 * length + i):
            ids += planner.plan(ChatRequest.ask(rec.question, rec.passages, ordering="retrieval")).ids
            if len(ids) >= length:
                break
        if len(ids) < length:
            ids = (ids * (length // max(len(ids), 1) + 1))
        out.append(ids[:length])
    return out


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class _HF:
    """transformers on the same directory, called the way its generate() prefills and decodes."""

    def __init__(self, model_dir, dtype: torch.dtype, attn: str | None):
        from transformers import AutoModelForCausalLM

        kwargs = {"attn_implementation": attn} if attn else {}
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **kwargs).eval()

    @torch.inference_mode()
    def prefill(self, ids: list[int]):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        out = self.model(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.past_key_values, out.logits[0, -1]

    @torch.inference_mode()
    def decode(self, cache, token: int):
        return self.model(torch.tensor([[token]]), past_key_values=cache, use_cache=True).logits[0, -1]


def _impls(model_dir, dtypes: tuple[str, ...], eager_row: bool) -> list[tuple[str, str, Any]]:
    """(impl name, dtype, runner) for each implementation the bench compares."""
    impls: list[tuple[str, str, Any]] = []
    for dt in dtypes:
        impls.append(("engine", dt, Engine.from_dir(model_dir, dt)))
        impls.append(("transformers", dt, _HF(model_dir, parse_dtype(dt), None)))
    if eager_row and "float32" in dtypes:
        impls.append(("transformers-eager-attn", "float32", _HF(model_dir, torch.float32, "eager")))
    return impls


def _one(name: str, runner, ids: list[int], length: int, decode_tokens: int) -> tuple[float, torch.Tensor, float]:
    """One prompt through one implementation: prefill ms, the last position's logits, decode ms per token."""
    if name == "engine":
        cache = runner.new_cache(length + decode_tokens + 1)
        box = {}
        ms = _time(lambda: box.setdefault("l", runner.forward(cache, ids)))
        logits = box["l"][0]
        step = lambda t, c=cache, r=runner: r.forward(c, [t])
    else:
        box = {}
        ms = _time(lambda: box.setdefault("r", runner.prefill(ids)))
        hf_cache, logits = box["r"]
        step = lambda t, c=hf_cache, r=runner: r.decode(c, t)
    token = int(logits.argmax())
    t0 = time.perf_counter()
    for _ in range(decode_tokens):
        token = int(step(token).argmax())
    return ms, logits, (time.perf_counter() - t0) * 1e3 / decode_tokens


def _measure(tick: Tick, impls, lengths: tuple[int, ...], prompts: dict[int, list[list[int]]], decode_tokens: int):
    """Every prompt through every implementation, the order alternating per prompt: prefill ms and decode
    ms per token per (impl, dtype, length), and each run's last logits per (impl, dtype, length, prompt)."""
    prefill: dict[tuple[str, str, int], list[float]] = {}
    decode: dict[tuple[str, str, int], list[float]] = {}
    last_logits: dict[tuple[str, str, int, int], torch.Tensor] = {}
    for L in lengths:
        for i, ids in enumerate(prompts[L]):
            order = impls if i % 2 == 0 else impls[::-1]  # alternate to spread drift evenly
            for name, dt, runner in order:
                tick(f"{name} {dt} {L} tokens")
                ms, logits, per_token = _one(name, runner, ids, L, decode_tokens)
                prefill.setdefault((name, dt, L), []).append(ms)
                last_logits[(name, dt, L, i)] = logits
                decode.setdefault((name, dt, L), []).append(per_token)
    return prefill, decode, last_logits


def _rows(ctx: BenchContext, impls, lengths: tuple[int, ...], prefill, decode, last_logits) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name, dt, _ in impls:
        for L in lengths:
            p50 = median(prefill[(name, dt, L)])
            base = median(prefill[("transformers", dt, L)]) if ("transformers", dt, L) in prefill else None
            dbase = median(decode[("transformers", dt, L)]) if ("transformers", dt, L) in decode else None
            row: dict[str, Any] = {
                "impl": name,
                "dtype": dt,
                "tokens": L,
                **timing_stats("prefill_ms", prefill[(name, dt, L)]),
                "prefill_tok_per_s": round(L / p50 * 1e3, 1),
                **timing_stats("decode_ms_per_token", decode[(name, dt, L)]),
                "prefill_engine_vs_transformers": (
                    round(p50 / base, 3) if name == "engine" and base else None
                ),
                "decode_engine_vs_transformers": (
                    round(median(decode[(name, dt, L)]) / dbase, 3) if name == "engine" and dbase else None
                ),
            }
            if name == "engine" and dt != "float32" and ("engine", "float32", L, 0) in last_logits:
                pairs = [(last_logits[("engine", "float32", L, i)], last_logits[("engine", dt, L, i)])
                         for i in range(ctx.count(3))]
                row["kl_vs_float32_p50"] = round(median([kl_divergence(a, b) for a, b in pairs]), 6)
                row["top1_agreement_vs_float32"] = sum(int(a.argmax() == b.argmax()) for a, b in pairs) / ctx.count(3)
            row["default"] = name == "engine" and dt == ctx.config.dtype and L == max(lengths)
            rows.append(row)
    return rows


def _summary(ctx: BenchContext, dtypes: tuple[str, ...], lengths: tuple[int, ...], prefill, decode,
             rows: list[dict[str, Any]]) -> dict[str, Any]:
    L = max(lengths)
    dt = ctx.config.dtype if ctx.config.dtype in dtypes else dtypes[0]
    summary: dict[str, Any] = {
        "dtype": dt,
        "tokens": L,
        "prefill_ratio_vs_transformers": round(
            median(prefill[("engine", dt, L)]) / median(prefill[("transformers", dt, L)]), 3
        ),
        "decode_ratio_vs_transformers": round(
            median(decode[("engine", dt, L)]) / median(decode[("transformers", dt, L)]), 3
        ),
    }
    if ("transformers-eager-attn", "float32", L) in prefill and dt == "float32":
        summary["prefill_ratio_vs_transformers_eager_attn"] = round(
            median(prefill[("engine", dt, L)]) / median(prefill[("transformers-eager-attn", "float32", L)]), 3
        )
    if "bfloat16" in dtypes and "float32" in dtypes:
        summary["bf16_prefill_vs_fp32"] = round(
            median(prefill[("engine", "bfloat16", L)]) / median(prefill[("engine", "float32", L)]), 3
        )
        summary["bf16_kl_vs_fp32_p50"] = next(
            r["kl_vs_float32_p50"]
            for r in rows
            if r["impl"] == "engine" and r["dtype"] == "bfloat16" and r["tokens"] == L
        )
    return summary


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    lengths = ctx.option("lengths", (512, 1024, 2048), lambda s: tuple(int(x) for x in s.split(",")))
    dtypes = ctx.option("dtypes", ("float32", "bfloat16"), lambda s: tuple(s.split(",")))
    decode_tokens = ctx.option("decode_tokens", 16, int)
    eager_row = ctx.option("eager", True, lambda s: s.lower() in ("1", "true", "yes"))
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    tokenizer = Tokenizer(model_dir)
    prompts = {L: _prompts(ctx, tokenizer, L, ctx.count(3)) for L in lengths}
    impls = _impls(model_dir, dtypes, eager_row)
    tick(total=len(impls) * len(lengths) * ctx.count(3))
    prefill, decode, last_logits = _measure(tick, impls, lengths, prompts, decode_tokens)
    rows = _rows(ctx, impls, lengths, prefill, decode, last_logits)
    summary = _summary(ctx, dtypes, lengths, prefill, decode, rows)
    config = {
        "model": str(ctx.config.model),
        "model_dir": str(model_dir),
        "lengths": list(lengths),
        "dtypes": list(dtypes),
        "decode_tokens": decode_tokens,
        "n": ctx.count(3),
        "seed": ctx.seed,
        "data": str(ctx.data) if ctx.data else "default",
    }
    return BenchResult("engine", config, rows, summary)


def plot(result: BenchResult, path) -> None:
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, dt in sorted({(r["impl"], r["dtype"]) for r in result.rows}):
        rs = [r for r in result.rows if r["impl"] == name and r["dtype"] == dt]
        xs = [r["tokens"] for r in rs]
        a1.plot(xs, [r["prefill_ms_p50"] for r in rs], marker="o", label=f"{name} {dt}")
        a2.plot(xs, [r["decode_ms_per_token_p50"] for r in rs], marker="o", label=f"{name} {dt}")
    a1.set(xlabel="prompt tokens", ylabel="prefill ms (p50)", title="prefill")
    a2.set(xlabel="context tokens", ylabel="ms / token (p50)", title="decode")
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
