"""``bench connector``'s recompute rows: span reuse repaired inside vLLM, judged over the whole answer.

Rows, after the pic rows on server A (each with A's prefix cache emptied first):

- ``span reuse, recompute in vLLM (default)``: the requests with ``contextkit.reuse = {}`` as the proxy
  sends them (policy "budget": the model's calibration profile, else query_attention r=0.3, cap 512, two
  sinks a span), the connector's worker recomputing the selected span tokens before vLLM reads them;
- ``span reuse, recompute in vLLM (kv_deviation)``: the same with CacheBlend's selection.

Fidelity against vLLM's own full prefill of the same prompt (same server, same dtype): the reference's
greedy answer (``ANSWER_TOKENS`` tokens, from a cold request) is fed back one token at a time
(``prompt + answer[:j]``, ``max_tokens=1``, the top ``TOP`` logprobs by token id), under the method's
parameters and salt, right after the method's own row, so its first step is the row's request (a local
hit of the KV the row repaired) and later steps extend it. ``prompt_logprobs``/``echo`` would do it in
one request, but vLLM skips every cache read (local and external) for such requests, so the method's KV
would never be used. Per request: ``tf_agreement`` (share of answer tokens that are the method's argmax;
``tf_agreement_tokens`` token-weighted over requests, ``tf_agreement_tie`` near-ties not counted, the gap
read from the reference's top logprobs: ``fidelity.token_gap``),
answer KL (mean over the answer's positions of the top-20 KL, ``fidelity.top_kl``), next-token top-1 and
KL (the first position). ``prefix caching`` (exact KV through vLLM's prefix cache) gets the same pass: the
same-dtype floor, what vLLM's own numerics move.
"""

from __future__ import annotations

from collections.abc import Callable

from contextkit.bench.harness import median, percentile, post_completion
from contextkit.integrations.vllm_connector.wire import RequestOptions
from contextkit.spans.fidelity import NEAR_TIE_NATS, token_gap, top_kl

RECOMPUTE = "span reuse, recompute in vLLM (default)"
KV_DEVIATION = "span reuse, recompute in vLLM (kv_deviation)"
ROWS = (RECOMPUTE, KV_DEVIATION)
ANSWER_TOKENS, TOP = 16, 20
OFF = RequestOptions(mode="off").encode()  # a measured full prefill


def reference_answers(url: str, prompts, salt: str) -> list[tuple[int, ...]]:
    """Each prompt's greedy answer under vLLM's full prefill (a fresh salt each, the connector off)."""
    out = []
    for i, plan in enumerate(prompts):
        _, obj = post_completion(url, {"prompt": plan.ids, "max_tokens": ANSWER_TOKENS, "temperature": 0,
                                       "cache_salt": f"{salt}-answer-{i}", "kv_transfer_params": OFF,
                                       "return_token_ids": True})
        out.append(tuple(obj["choices"][0].get("token_ids") or ()))
    return out


def teacher_forced(url: str, prompts, answers, body: Callable[[int, object, list[int]], dict]
                   ) -> list[list[dict[int, float]]]:
    """Per prompt, the top logprobs (by token id) at every answer position, the answer fed back; ``body(i,
    plan, ids)`` makes the request for prompt i's plan with token ids ``ids`` (its salt and parameters)."""
    out = []
    for i, (plan, answer) in enumerate(zip(prompts, answers)):
        dists = []
        for j in range(max(1, len(answer))):
            req = {**body(i, plan, list(plan.ids) + list(answer[:j])), "max_tokens": 1, "temperature": 0,
                   "logprobs": TOP, "return_tokens_as_token_ids": True}
            _, obj = post_completion(url, req)
            top = (obj["choices"][0].get("logprobs") or {}).get("top_logprobs") or [{}]
            dists.append({int(t.rsplit(":", 1)[1]): lp for t, lp in (top[0] or {}).items()})
        out.append(dists)
    return out


def answer_fidelity(reference: list[list[dict[int, float]]], answers, method: list[list[dict[int, float]]]) -> dict:
    """The row's fidelity against the reference pass (module docstring)."""
    tf, tie, kl, top1, kl0 = [], [], [], [], []
    agreed = tokens = 0
    for ref, ans, got in zip(reference, answers, method):
        n = min(len(ans), len(got), len(ref))
        if n:
            mine = [max(got[j], key=got[j].get) for j in range(n)]
            hits = sum(mine[j] == ans[j] for j in range(n))
            tf.append(hits / n)
            agreed, tokens = agreed + hits, tokens + n
            tie.append(sum(token_gap(ref[j], target=ans[j], token=mine[j]) <= NEAR_TIE_NATS for j in range(n)) / n)
            kl.append(sum(top_kl(ref[j], got[j]) for j in range(n)) / n)
        top1.append(max(got[0], key=got[0].get) == max(ref[0], key=ref[0].get))
        kl0.append(top_kl(ref[0], got[0]))
    return {"tf_agreement": round(sum(tf) / len(tf), 3) if tf else None,
            "tf_agreement_tokens": round(agreed / tokens, 3) if tokens else None,
            "tf_agreement_tie": round(sum(tie) / len(tie), 3) if tie else None,
            "answer_kl_p50": round(median(kl), 4) if kl else None,
            "answer_kl_p90": round(percentile(kl, 90), 4) if kl else None,
            "top1_agreement_20": round(sum(top1) / len(top1), 3), "kl_p50": round(median(kl0), 4),
            "kl_p90": round(percentile(kl0, 90), 4)}


def repair_cost(metrics_before: dict[str, float], metrics_after: dict[str, float]) -> dict:
    """Worker time per repair and repairs counted, from the server's connector counters."""
    repairs = metrics_after.get("repairs", 0) - metrics_before.get("repairs", 0)
    ms = metrics_after.get("repair_ms", 0) - metrics_before.get("repair_ms", 0)
    failures = metrics_after.get("repair_failures", 0) - metrics_before.get("repair_failures", 0)
    return {"repairs": int(repairs), "repair_ms_mean": round(ms / repairs, 1) if repairs else None,
            "repair_failures": int(failures)}


def connector_counters(url: str) -> dict[str, float]:
    """The server's ``contextkit_connector_*`` counters (totals), by short name."""
    from contextkit.bench.stream_client import scrape_metrics

    return {name.removeprefix("contextkit_connector_").removesuffix("_total"): value
            for name, value in scrape_metrics(url, timeout_s=30).items()
            if name.startswith("contextkit_connector_") and name.endswith("_total")}


def engine_weights_mb(model_dir, dtype: str) -> float:
    """Resident memory the connector's repair engine adds (its weights, float32 head included), measured by
    loading the same engine in this process: what server A loaded at its start, before any row ran."""
    import gc

    import psutil

    from contextkit.engine.model import Engine

    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    engine = Engine.from_dir(model_dir, dtype=dtype)
    grown = proc.memory_info().rss - before
    del engine
    gc.collect()
    return round(grown / 2**20, 1)
