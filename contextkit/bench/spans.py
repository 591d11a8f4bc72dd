"""``contextkit bench spans``: span reuse with each recompute policy vs full prefill, on real QA data.

Each question's passages are spans compiled beforehand (compile time reported apart); the context is
system prompt + all passages + question, rendered as the chat template's segments. Per method the same
prompts in the same run, methods interleaved in a rotating order per question:

- TTFT: wall time of ``SpanCache.assemble`` (fetch, re-rotate, select, recompute + query prefill) up to
  the first token's logits; ``full`` is the plain prefill of the same tokens.
- Fidelity vs full prefill: next-token KL(full || method), first-token top-1 agreement, and whether the
  greedy continuation (up to 32 tokens or EOS) is identical (``greedy_match_32``).
- Answer quality: SQuAD F1 / EM of the greedy answer against the gold answers.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from contextkit.bench.data import load_records, sample
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import answer_em, answer_f1, kl_divergence
from contextkit.core.generation import SamplingParams
from contextkit.engine.generate import generate
from contextkit.core.errors import InputError
from contextkit.engine.model import Engine
from contextkit.core.models import resolve_model_dir
from contextkit.core.plan import ReuseOptions
from contextkit.core.planner import ChatRequest, Planner
from contextkit.spans.assemble import SpanCache
from contextkit.core.tokenizer import Tokenizer

RATIOS = (0.05, 0.1, 0.15, 0.3)


def methods(first_k: int) -> dict[str, ReuseOptions]:
    """The compared configurations; "+ first 2" adds each span's first two tokens to the policy's pick."""
    out = {"full": ReuseOptions(policy="full"), "reuse": ReuseOptions(policy="none", first_k=0)}
    for r in RATIOS:
        out[f"query_attention r={r}"] = ReuseOptions(policy="query_attention", ratio=r, first_k=0)
    for r in RATIOS:
        out[f"kv_deviation r={r}"] = ReuseOptions(policy="kv_deviation", ratio=r, first_k=0)
    out[f"first_k k={first_k}"] = ReuseOptions(policy="first_k", first_k=first_k)
    for r in (0.05, 0.1):
        out[f"query_attention r={r} + first 2"] = ReuseOptions(policy="query_attention", ratio=r, first_k=2)
    out["query_attention budget=0.1"] = ReuseOptions(policy="query_attention", fidelity_budget=0.1, first_k=0)
    return out


def default_method(names: dict[str, ReuseOptions]) -> str:
    """The row that uses the library's default ReuseOptions."""
    d = ReuseOptions()
    for name, opts in names.items():
        if opts == d:
            return name
    raise AssertionError("the default ReuseOptions must be one of the bench's methods")


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    min_tokens = ctx.option("min_tokens", 1000, int)
    max_tokens = ctx.option("max_tokens", 2100, int)
    decode = ctx.option("decode_tokens", 32, int)
    first_k = ctx.option("first_k", 8, int)
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    engine = Engine.from_dir(model_dir, ctx.config.dtype)
    tok = Tokenizer(model_dir)
    planner = Planner(tok, context_limit=engine.spec.max_positions)
    cache = SpanCache(engine, tokenizer_fingerprint=tok.fingerprint)
    table = methods(first_k)

    # questions whose rendered context is in the length band, drawn with the seed
    chosen = []
    records = load_records(ctx.data)
    for rec in sample(records, len(records), ctx.seed):
        # retrieval order: the bench measures reuse at the positions the data gives
        plan = planner.plan(ChatRequest.ask(rec.question, rec.passages, ordering="retrieval", max_new_tokens=decode))
        if min_tokens <= plan.num_tokens <= max_tokens:
            chosen.append((rec, plan))
        if len(chosen) == ctx.count(50):
            break
    if not chosen:
        raise InputError(
            f"no question renders to {min_tokens}..{max_tokens} tokens; widen --set min_tokens=/max_tokens="
        )
    tick(total=len(chosen) * (len(table) + 1))

    per: dict[str, dict[str, list[float]]] = {m: {} for m in table}
    compile_ms: list[float] = []
    params = SamplingParams(max_new_tokens=decode)
    for qi, (rec, plan) in enumerate(chosen):
        items = plan.items
        tick(f"compile q{qi}")
        t0 = time.perf_counter()
        for it in items[:-1]:
            cache.compiled(it.span)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        names = list(table)
        k = qi % len(names)
        order = names[k:] + names[:k]  # rotate so no method always runs first or last
        results: dict[str, tuple[torch.Tensor, tuple[int, ...], str, float, Any]] = {}
        for name in order:
            tick(f"{name} q{qi}")
            t0 = time.perf_counter()
            asm = cache.assemble(dataclasses.replace(plan, options=table[name]), extra_capacity=decode + 1)
            ttft = (time.perf_counter() - t0) * 1e3
            gen = generate(engine, tok, plan.ids, params, cache=asm.cache, first_logits=asm.logits)
            results[name] = (asm.logits[0], gen.token_ids, gen.text, ttft, asm.report)
        ref_logits, ref_tokens, _, _, _ = results["full"]
        for name, (logits, tokens, text, ttft, report) in results.items():
            m = per[name]
            m.setdefault("ttft", []).append(ttft)
            m.setdefault("kl", []).append(kl_divergence(ref_logits, logits))
            m.setdefault("top1", []).append(float(int(logits.argmax()) == int(ref_logits.argmax())))
            m.setdefault("match", []).append(float(tokens == ref_tokens))
            m.setdefault("f1", []).append(answer_f1(text, rec.answers))
            m.setdefault("em", []).append(answer_em(text, rec.answers))
            m.setdefault("recomputed", []).append(report.recomputed_tokens)
            m.setdefault("context", []).append(report.context_tokens)

    full_ttft = median(per["full"]["ttft"])
    dflt = default_method(table)
    rows = []
    for name, m in per.items():
        rows.append({
            "method": name,
            "policy": table[name].policy,
            "ttft_ms_p50": round(median(m["ttft"]), 1),
            "ttft_ms_p90": round(percentile(m["ttft"], 90), 1),
            "speedup_vs_full": round(full_ttft / median(m["ttft"]), 2),
            "kl_p50": round(median(m["kl"]), 4),
            "kl_p90": round(percentile(m["kl"], 90), 4),
            "top1_agreement": round(sum(m["top1"]) / len(m["top1"]), 3),
            "greedy_match_32": round(sum(m["match"]) / len(m["match"]), 3),
            "answer_f1": round(100 * sum(m["f1"]) / len(m["f1"]), 2),
            "answer_em": round(100 * sum(m["em"]) / len(m["em"]), 2),
            "recomputed_tokens_p50": median(m["recomputed"]),
            "default": name == dflt,
        })
    by = {r["method"]: r for r in rows}
    fast = [r for r in rows if r["method"] != "full" and r["top1_agreement"] >= 0.8]
    max_speed = max(fast, key=lambda r: r["speedup_vs_full"]) if fast else by["reuse"]
    summary = {
        "questions": len(chosen),
        "default_method": dflt,
        "speedup_vs_full": by[dflt]["speedup_vs_full"],
        "kl_p50": by[dflt]["kl_p50"],
        "top1_agreement": by[dflt]["top1_agreement"],
        "answer_f1_delta": round(by[dflt]["answer_f1"] - by["full"]["answer_f1"], 2),
        "max_speed_method": max_speed["method"],
        "max_speed_speedup": max_speed["speedup_vs_full"],
        "max_speed_top1": max_speed["top1_agreement"],
        "full_ttft_ms_p50": by["full"]["ttft_ms_p50"],
        "compile_ms_p50_per_question": round(median(compile_ms), 1),
        "context_tokens_p50": median(per["full"]["context"]),
    }
    config = {
        "model": ctx.config.model, "dtype": ctx.config.dtype, "n": len(chosen), "seed": ctx.seed,
        "data": str(ctx.data) if ctx.data else "default", "min_tokens": min_tokens, "max_tokens": max_tokens,
        "decode_tokens": decode, "rerotate_path": cache.rerotator.path,
        "rerotate_calls": dict(cache.rerotator.calls), "rerotate_fallbacks": dict(cache.rerotator.fallbacks),
    }
    return BenchResult("spans", config, rows, summary)


def plot(result: BenchResult, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in result.rows:
        if r["method"] == "full":
            continue
        ax.scatter(r["speedup_vs_full"], r["kl_p50"], s=30)
        ax.annotate(r["method"], (r["speedup_vs_full"], r["kl_p50"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xlabel="TTFT speedup vs full prefill (p50)", ylabel="next-token KL vs full (p50)",
           title="span reuse: speed vs fidelity", yscale="log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
