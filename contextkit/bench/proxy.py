"""``contextkit bench proxy``: what the proxy adds to latency, and what it saves on a documents workload.

The proxy runs as it is deployed (``contextkit proxy`` in its own process) in front of a real vLLM
server (``--upstream URL``, or one this bench starts and stops).

1. Overhead: at 1, 16 and 64 concurrent streaming clients, each request of the stream (short chats, the
   trace's questions) is sent directly and through the proxy, back to back in alternating order, each
   with its own ``cache_salt`` so neither warms the other's cache. Overhead = TTFT through the proxy
   minus TTFT direct, per pair; p50 and p99 per concurrency. (Sending both at once was tried: the later
   arrival waits one engine step on a CPU server, which measures vLLM's scheduler, not the proxy.)
2. Documents: the trace's requests in arrival order, sequentially, directly to vLLM in retrieval order
   (token ids rendered the same way, ``bench ordering``'s ``retrieval`` policy) and then through the
   proxy as chat requests with ``documents`` and the tenant; vLLM's prefix cache emptied in between.
3. Soak (``--set soak_s=300``): 64 concurrent streaming clients through the proxy for that long; errors
   counted, the proxy's resident memory sampled after the first 10% and at the end.

The proxy also reports its own time per request, from arrival to forwarding (``x-contextkit-proxy-ms``
header): ``proxy_internal_ms_p50/p99``, the part of the overhead the proxy controls, free of the
upstream scheduler's noise that dominates the TTFT difference under load on a small CPU server.

Summary: ``overhead_ms_p50``, ``overhead_ms_p99`` (at the highest concurrency), ``errors``,
``docs_ttft_reduction_vs_direct`` (1 - proxy TTFT p50 / direct TTFT p50), ``rss_growth`` (soak).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile
from contextkit.bench.ordering import TraceRenderer, load_stream
from contextkit.errors import ConfigError
from contextkit.integrations.vllm_server import (
    VLLMServer, VLLMServerConfig, free_port, reset_prefix_cache, served_model, wait_for_health,
)  # fmt: skip
from contextkit.models import prepare
from contextkit.tokenizer import Tokenizer


async def _ttft(client: httpx.AsyncClient, url: str, body: dict, internal: list | None = None) -> tuple[float, bool]:
    """(ms to the first content chunk, ok) of one streaming request; appends the proxy's own
    pre-forwarding time (its ``x-contextkit-proxy-ms`` header) to ``internal`` when given."""
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return (time.perf_counter() - t0) * 1e3, False
            if internal is not None and "x-contextkit-proxy-ms" in r.headers:
                internal.append(float(r.headers["x-contextkit-proxy-ms"]))
            first = None
            async for line in r.aiter_lines():
                if first is None and line.startswith("data:") and '"choices":[{' in line.replace(" ", ""):
                    first = time.perf_counter()
            return ((first or time.perf_counter()) - t0) * 1e3, True
    except httpx.HTTPError:
        return (time.perf_counter() - t0) * 1e3, False


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _overhead(direct: str, proxy: str, model: str, questions: list[str], conc: int, max_tokens: int):
    limits = httpx.Limits(max_connections=conc * 2 + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        work = list(enumerate(questions))
        pairs, errors, internal = [], 0, []

        async def worker() -> None:
            nonlocal errors
            while work:
                i, q = work.pop()
                body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True}
                # back to back, alternating which goes first (sending both at once makes the second
                # arrival wait one engine step on a CPU server: that measured vLLM, not the proxy)
                sends = [direct, proxy] if i % 2 else [proxy, direct]
                got = {}
                for base in sends:
                    got[base] = await _ttft(client, base + "/v1/chat/completions",
                                            {**body, "cache_salt": uuid.uuid4().hex},
                                            internal if base == proxy else None)
                if got[direct][1] and got[proxy][1]:
                    pairs.append((got[direct][0], got[proxy][0]))
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(conc)))
    return pairs, errors, internal


async def _soak(proxy: str, model: str, questions: list[str], seconds: float, pid: int, max_tokens: int):
    deadline = time.monotonic() + seconds
    rss = {}
    ok = errors = 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        async def worker(w: int) -> None:
            nonlocal ok, errors
            i = w
            while time.monotonic() < deadline:
                body = {"model": model, "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                        "max_tokens": max_tokens, "temperature": 0, "stream": True}
                _, good = await _ttft(client, proxy + "/v1/chat/completions", body)
                ok, errors = ok + good, errors + (not good)
                i += 64

        async def sampler() -> None:
            await asyncio.sleep(seconds * 0.1)
            rss["start"] = _rss_kb(pid)
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
            rss["end"] = _rss_kb(pid)

        await asyncio.gather(sampler(), *(worker(w) for w in range(64)))
    return ok, errors, rss


async def _docs(client: httpx.AsyncClient, direct: str, proxy: str, model: str, requests, renderer, max_tokens):
    rows = {"direct": [], "proxy": []}
    reset_prefix_cache(direct)
    for req in requests:
        ids, _ = renderer.ids(req, tuple(range(len(req.documents))), aligned=False)
        body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        if req.tenant:
            body["cache_salt"] = req.tenant
        rows["direct"].append(await _ttft(client, direct + "/v1/completions", body))
    reset_prefix_cache(direct)
    for req in requests:
        body = {"model": model, "messages": [{"role": "user", "content": req.question}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True,
                "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in req.documents],
                "contextkit": {"tenant": req.tenant}}
        rows["proxy"].append(await _ttft(client, proxy + "/v1/chat/completions", body))
    return rows


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    levels = [int(c) for c in ctx.option("concurrency", "1,16,64").split(",")]
    per_level = ctx.option("requests_per_level", 128, int)
    max_tokens = ctx.option("max_tokens", 8, int)
    soak_s = ctx.option("soak_s", 0.0, float)
    block = ctx.option("block_size", 32, int)
    requests = load_stream(ctx, ctx.option("k", 10, int))
    model_dir = prepare(ctx.config.model, ctx.config.cache_dir)
    renderer = TraceRenderer(Tokenizer(model_dir), block)
    upstream = ctx.option("upstream", "")
    server = proxy_proc = None
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    summary: dict = {}
    try:
        if not upstream:
            tick("starting vLLM")
            server = VLLMServer(VLLMServerConfig(model_dir=model_dir, block_size=block,
                                                 log_file=logs / "bench-proxy-vllm.log")).start()
            upstream = server.url
        model = served_model(upstream)
        port = free_port()
        exe = [sys.executable, "-m", "contextkit.cli", "proxy", "--upstream", upstream, "--port", str(port),
               "--block-size", str(block), "--model", ctx.config.model]
        env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(ctx.config.cache_dir))
        with open(logs / "bench-proxy.log", "ab") as log:
            proxy_proc = subprocess.Popen(exe, stdout=log, stderr=subprocess.STDOUT, env=env)
        proxy = f"http://127.0.0.1:{port}"
        wait_for_health(proxy, 120)
        questions = [r.question for r in requests]
        questions = (questions * (per_level // max(1, len(questions)) + 1))[:per_level]
        tick(total=len(levels) + 2)
        errors = 0
        for conc in levels:
            pairs, errs, internal = asyncio.run(_overhead(upstream, proxy, model, questions, conc, max_tokens))
            errors += errs
            if not pairs:
                raise ConfigError(f"no request succeeded at concurrency {conc}; see {logs}")
            diff = [p - d for d, p in pairs]
            rows.append({"phase": "overhead", "concurrency": conc, "requests": len(pairs), "errors": errs,
                         "direct_ttft_ms_p50": round(percentile([d for d, _ in pairs], 50), 2),
                         "proxy_ttft_ms_p50": round(percentile([p for _, p in pairs], 50), 2),
                         "overhead_ms_p50": round(percentile(diff, 50), 3),
                         "overhead_ms_p99": round(percentile(diff, 99), 3),
                         "proxy_internal_ms_p50": round(percentile(internal, 50), 3) if internal else None,
                         "proxy_internal_ms_p99": round(percentile(internal, 99), 3) if internal else None})
            tick(f"overhead at {conc}")
        top = rows[-1]
        summary.update(overhead_ms_p50=top["overhead_ms_p50"], overhead_ms_p99=top["overhead_ms_p99"],
                       overhead_at_concurrency=top["concurrency"],
                       proxy_internal_ms_p50=top["proxy_internal_ms_p50"],
                       proxy_internal_ms_p99=top["proxy_internal_ms_p99"])

        async def docs_phase():
            async with httpx.AsyncClient(timeout=600) as client:
                return await _docs(client, upstream, proxy, model, requests, renderer, max_tokens)

        docs = asyncio.run(docs_phase())
        for arm in ("direct", "proxy"):
            ms = [t for t, good in docs[arm] if good]
            errors += sum(1 for _, good in docs[arm] if not good)
            rows.append({"phase": "documents", "arm": arm + (" (retrieval order)" if arm == "direct" else " (weaver)"),
                         "requests": len(ms), "ttft_ms_p50": round(percentile(ms, 50), 2),
                         "ttft_ms_p90": round(percentile(ms, 90), 2), "default": arm == "proxy"})
        tick("documents")
        d50 = statistics.median(t for t, g in docs["direct"] if g)
        p50 = statistics.median(t for t, g in docs["proxy"] if g)
        summary["docs_ttft_reduction_vs_direct"] = round(1 - p50 / d50, 4)
        if soak_s > 0:
            ok, errs, rss = asyncio.run(_soak(proxy, model, questions, soak_s, proxy_proc.pid, max_tokens))
            errors += errs
            growth = (rss["end"] - rss["start"]) / rss["start"] if rss.get("start") else None
            rows.append({"phase": "soak", "concurrency": 64, "seconds": soak_s, "requests": ok + errs, "errors": errs,
                         "rss_mb_start": round(rss.get("start", 0) / 1024, 1), "rss_mb_end": round(rss.get("end", 0) / 1024, 1)})
            summary.update(soak_s=soak_s, soak_requests=ok + errs, soak_errors=errs,
                           rss_growth=round(growth, 4) if growth is not None else None)
        tick("soak")
        summary["errors"] = errors
    finally:
        if proxy_proc is not None:
            proxy_proc.terminate()
            try:
                proxy_proc.wait(30)
            except subprocess.TimeoutExpired:
                proxy_proc.kill()
        if server is not None:
            server.stop()
    config = {"concurrency": levels, "requests_per_level": per_level, "max_tokens": max_tokens, "soak_s": soak_s,
              "documents_requests": len(requests), "upstream": ctx.option("upstream", "") or "started by the bench",
              "trace": ctx.option("trace", None)}
    return BenchResult("proxy", config, rows, summary)


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    rs = [r for r in result.rows if r["phase"] == "overhead"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["concurrency"] for r in rs], [r["overhead_ms_p50"] for r in rs], marker="o", label="p50")
    ax.plot([r["concurrency"] for r in rs], [r["overhead_ms_p99"] for r in rs], marker="o", label="p99")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("proxy overhead on TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

