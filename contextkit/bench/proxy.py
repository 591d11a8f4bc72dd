"""``contextkit bench proxy``: what the proxy adds to latency, and what it saves on a documents workload.

The proxy runs as it is deployed (``contextkit proxy`` in its own process) in front of a real vLLM
server (``--upstream URL``, or one this bench starts and stops). When the bench starts vLLM on a
machine with >= 2 cores, the engine gets all cores but the last and the proxy and the load generator
the last (``--set pin=0`` shares them; ``--set proxy_cpus=N``): a proxy in front of a GPU server has a
core of its own, while on a CPU engine spread over every core the difference measures a fight for CPU.

1. Overhead at 1, 16 and 64 concurrent streaming clients on the same request stream (short chats, the
   trace's questions). Each request goes directly and through the proxy, back to back in alternating
   order, each with its own ``cache_salt``. The load generator is a raw asyncio protocol that stamps
   the first event as its bytes arrive (a few microseconds per chunk). Two estimates:
   - ``overhead_ms`` (the headline, per request): TTFT through the proxy as the client saw it minus
     the same request's TTFT as the proxy saw it upstream (forwarding to first body bytes; from the
     proxy's access log, joined on ``x-request-id``; one monotonic clock). vLLM's queueing cancels
     exactly; what remains is the extra hop in and out, the proxy's own work and its event-loop queue,
     plus the load generator's own scheduling delays (which a direct request would also see: the
     estimate errs against the proxy). Not in it: a queue inside the proxy between the first bytes
     reaching its socket and its relay reading them (DEVELOPERS.md says what that measured).
   - ``paired_overhead_ms``: proxied TTFT minus the direct TTFT of the same prompt sent just before or
     after. Under load the two land in different engine steps, so this measures vLLM's scheduling
     noise as much as the proxy: the ``A/A control`` row applies it to direct vs direct.
   The load generator runs in its own process at ``nice`` +10 (``--set client_nice``), so on the core it
   shares with the proxy the proxy runs first; the highest concurrency is run 3 times (``--set
   repeats``): the headline is the median run, ``overhead_ms_p99_max`` the worst, all of them listed.
2. Documents: the trace's requests in arrival order, sequentially, directly to vLLM in retrieval order
   (token ids rendered the same way, ``bench ordering``'s ``retrieval`` policy) and then through the
   proxy as chat requests with ``documents`` and the tenant; vLLM's prefix cache emptied in between.
3. Soak (``--set soak_s=300``): 64 concurrent streaming clients through the proxy for that long; errors
   counted, the proxy's resident memory sampled after the first 10% and at the end.

Summary: ``overhead_ms_p50``, ``overhead_ms_p99`` (at the highest concurrency, the median of the runs there;
``overhead_ms_p99_runs``, ``_min``, ``_max``), ``paired_overhead_ms_*``,
``control_paired_overhead_ms_p99``, ``proxy_ms_*`` (arrival to forwarding), ``proxy_cpu_ms_per_request``,
``errors``, ``docs_ttft_reduction_vs_direct`` (1 - proxy TTFT p50 / direct TTFT p50), ``rss_growth``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile
from contextkit.bench.host import cpu_s, rss_kb, split_cpus
from contextkit.bench.loadgen import LoadGenerator
from contextkit.bench.ordering import TraceRenderer, load_stream
from contextkit.bench.stream_client import stream_async
from contextkit.core.errors import ConfigError
from contextkit.core.models import resolve_model_dir
from contextkit.core.tokenizer import Tokenizer
from contextkit.integrations.launchers.servers import proxy_process
from contextkit.integrations.launchers.vllm_server import (
    VLLMServer,
    VLLMServerConfig,
    reset_prefix_cache,
    served_model,
)


async def _ttft(session: aiohttp.ClientSession, url: str, body: dict, rid: str | None = None) -> tuple[float, bool]:
    """(ms to the first content delta, ok) of one streaming request; ``rid`` goes out as ``x-request-id``
    (the proxy logs its own timings under it)."""
    t0 = time.perf_counter()
    try:
        s = await stream_async(session, url, body, {"x-request-id": rid} if rid else None)
    except (aiohttp.ClientError, TimeoutError):
        return (time.perf_counter() - t0) * 1e3, False
    return s.ttft_ms, s.status == 200


def _session(connections: int) -> aiohttp.ClientSession:
    # aiohttp, like the proxy: httpx's pool costs O(connections) per event, which at 64 streams made
    # the load generator itself a CPU hog competing with what it measures
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=600))


def _proxy_timings(log: Path, offset: int, want: set[str], wait_s: float = 5.0) -> dict[str, dict]:
    """The proxy's access-log records (JSON lines) written after ``offset``, by request id. The proxy
    writes a request's line after its last byte went out, so the client can be faster: wait (up to
    ``wait_s``) until every id in ``want`` is there."""
    deadline = time.monotonic() + wait_s
    while True:
        out = {}
        with open(log, "rb") as f:
            f.seek(offset)
            for line in f:
                try:
                    event = json.loads(line).get("event")
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("request_id"):
                    out[event["request_id"]] = event
        if want <= out.keys() or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


async def _soak(proxy: str, model: str, questions: list[str], seconds: float, pid: int, max_tokens: int):
    deadline = time.monotonic() + seconds
    rss = {}
    ok = errors = 0
    async with _session(200) as session:
        async def worker(w: int) -> None:
            nonlocal ok, errors
            i = w
            while time.monotonic() < deadline:
                body = {"model": model, "messages": [{"role": "user", "content": questions[i % len(questions)]}],
                        "max_tokens": max_tokens, "temperature": 0, "stream": True}
                _, good = await _ttft(session, proxy + "/v1/chat/completions", body)
                ok, errors = ok + good, errors + (not good)
                i += 64

        async def sampler() -> None:
            await asyncio.sleep(seconds * 0.1)
            rss["start"] = rss_kb(pid)
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
            rss["end"] = rss_kb(pid)

        await asyncio.gather(sampler(), *(worker(w) for w in range(64)))
    return ok, errors, rss


async def _docs(direct: str, proxy: str, model: str, requests, renderer, max_tokens):
    rows = {"direct": [], "proxy": []}
    async with _session(8) as session:
        reset_prefix_cache(direct)
        for req in requests:
            ids, _ = renderer.ids(req, tuple(range(len(req.documents))), aligned=False)
            body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
            if req.tenant:
                body["cache_salt"] = req.tenant
            rows["direct"].append(await _ttft(session, direct + "/v1/completions", body))
        reset_prefix_cache(direct)
        for req in requests:
            body = {"model": model, "messages": [{"role": "user", "content": req.question}],
                    "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in req.documents],
                    "contextkit": {"tenant": req.tenant}}
            rows["proxy"].append(await _ttft(session, proxy + "/v1/chat/completions", body))
    return rows


def _overhead_row(label: str, conc: int, pairs, errs: int, by_id: dict, timings: dict, cpu_ms: float | None) -> dict:
    diff = [b - a for a, b in pairs]
    same = [ms - timings[rid]["upstream_ttft_ms"] for rid, ms in by_id.items()
            if timings.get(rid, {}).get("upstream_ttft_ms") is not None]
    ours = [timings[rid]["proxy_ms"] for rid in by_id if timings.get(rid, {}).get("proxy_ms") is not None]

    def q(xs, pct):
        return round(percentile(xs, pct), 3) if xs else None

    return {"phase": label, "concurrency": conc, "requests": len(pairs), "errors": errs,
            "direct_ttft_ms_p50": round(percentile([a for a, _ in pairs], 50), 2),
            "proxy_ttft_ms_p50": round(percentile([b for _, b in pairs], 50), 2),
            "overhead_ms_p50": q(same, 50), "overhead_ms_p99": q(same, 99), "matched": len(same),
            "paired_overhead_ms_p50": q(diff, 50), "paired_overhead_ms_p99": q(diff, 99),
            "proxy_ms_p50": q(ours, 50), "proxy_ms_p99": q(ours, 99), "proxy_cpu_ms_per_request": cpu_ms}


@dataclass(frozen=True, slots=True)
class _Target:
    """What the phases measure: vLLM directly and the proxy in front of it."""

    upstream: str
    proxy: str
    model: str
    proxy_pid: int
    proxy_log: Path
    max_tokens: int


def _overhead_phase(ctx: BenchContext, tick: Tick, t: _Target, questions: list[str], rows: list[dict],
                    summary: dict) -> int:
    """Direct vs proxied TTFT at each concurrency (the highest ``repeats`` times), then the A/A control;
    the errors."""
    levels = [int(c) for c in ctx.option("concurrency", "1,16,64").split(",")]
    repeats, control = ctx.option("repeats", 3, int), ctx.option("control", 1, int)
    errors = 0
    client = LoadGenerator(ctx.option("client_nice", 10, int))  # after the affinity change: on the proxy's core
    tops = []
    for conc in levels + [levels[-1]] * (repeats - 1):
        offset, cpu0 = t.proxy_log.stat().st_size, cpu_s(t.proxy_pid)
        pairs, errs, by_id = client.overhead(t.upstream, t.proxy, t.model, questions, conc, t.max_tokens)
        cpu_ms = round((cpu_s(t.proxy_pid) - cpu0) * 1e3 / max(1, len(by_id)), 3)
        errors += errs
        if not pairs:
            raise ConfigError(f"no request succeeded at concurrency {conc}; see {t.proxy_log.parent}")
        rows.append(_overhead_row("overhead", conc, pairs, errs, by_id, _proxy_timings(t.proxy_log, offset, set(by_id)),
                                  cpu_ms))
        if conc == levels[-1]:
            rows[-1]["repeat"] = len(tops) + 1
            tops.append(rows[-1])
        tick(f"overhead at {conc}")
    top = sorted(tops, key=lambda r: r["overhead_ms_p99"] or 0.0)[len(tops) // 2]  # the median run
    p99s = sorted(r["overhead_ms_p99"] for r in tops if r["overhead_ms_p99"] is not None)
    summary.update(overhead_ms_p99_runs=[r["overhead_ms_p99"] for r in tops],
                   overhead_ms_p99_median=p99s[len(p99s) // 2] if p99s else None,
                   overhead_ms_p99_max=p99s[-1] if p99s else None, overhead_ms_p99_min=p99s[0] if p99s else None)
    if control:  # the paired estimator on direct vs direct: its spread is the engine's, not the proxy's
        pairs, errs, _ = client.overhead(t.upstream, t.upstream, t.model, questions, levels[-1], t.max_tokens)
        rows.append(_overhead_row("A/A control", levels[-1], pairs, errs, {}, {}, None))
        summary["control_paired_overhead_ms_p99"] = rows[-1]["paired_overhead_ms_p99"]
        tick("control")
    client.close()
    summary.update({k: top[k] for k in ("overhead_ms_p50", "overhead_ms_p99", "paired_overhead_ms_p50",
                                        "paired_overhead_ms_p99", "proxy_ms_p50", "proxy_ms_p99",
                                        "proxy_cpu_ms_per_request")},
                   overhead_at_concurrency=top["concurrency"])
    return errors


def _docs_phase(t: _Target, requests, renderer: TraceRenderer, rows: list[dict], summary: dict) -> int:
    """The documents trace directly in retrieval order, then through the proxy; the errors."""
    docs = asyncio.run(_docs(t.upstream, t.proxy, t.model, requests, renderer, t.max_tokens))
    errors = 0
    for arm in ("direct", "proxy"):
        ms = [ms for ms, good in docs[arm] if good]
        errors += sum(1 for _, good in docs[arm] if not good)
        rows.append({"phase": "documents", "arm": arm + (" (retrieval order)" if arm == "direct" else " (weaver)"),
                     "requests": len(ms), "ttft_ms_p50": round(percentile(ms, 50), 2),
                     "ttft_ms_p90": round(percentile(ms, 90), 2), "default": arm == "proxy"})
    d50 = statistics.median(ms for ms, g in docs["direct"] if g)
    p50 = statistics.median(ms for ms, g in docs["proxy"] if g)
    summary["docs_ttft_reduction_vs_direct"] = round(1 - p50 / d50, 4)
    return errors


def _soak_phase(t: _Target, questions: list[str], soak_s: float, rows: list[dict], summary: dict) -> int:
    """64 streams through the proxy for ``soak_s``, its RSS sampled; the errors."""
    ok, errs, rss = asyncio.run(_soak(t.proxy, t.model, questions, soak_s, t.proxy_pid, t.max_tokens))
    growth = (rss["end"] - rss["start"]) / rss["start"] if rss.get("start") else None
    rows.append({"phase": "soak", "concurrency": 64, "seconds": soak_s, "requests": ok + errs, "errors": errs,
                 "rss_mb_start": round(rss.get("start", 0) / 1024, 1),
                 "rss_mb_end": round(rss.get("end", 0) / 1024, 1)})
    summary.update(soak_s=soak_s, soak_requests=ok + errs, soak_errors=errs,
                   rss_growth=round(growth, 4) if growth is not None else None)
    return errs


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    levels = [int(c) for c in ctx.option("concurrency", "1,16,64").split(",")]
    per_level = ctx.option("requests_per_level", 128, int)
    max_tokens = ctx.option("max_tokens", 8, int)
    soak_s = ctx.option("soak_s", 0.0, float)
    block = ctx.option("block_size", 32, int)
    control = ctx.option("control", 1, int)
    repeats = ctx.option("repeats", 3, int)  # runs at the highest concurrency: the p99's spread
    client_nice = ctx.option("client_nice", 10, int)
    if repeats < 1 or not 0 <= client_nice <= 19:
        raise ConfigError("--set repeats must be >= 1 and --set client_nice in 0..19")
    requests = load_stream(ctx, ctx.option("k", 10, int))
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    renderer = TraceRenderer(Tokenizer(model_dir), block)
    upstream = ctx.option("upstream", "")
    engine_cpus, proxy_cpus = split_cpus(bool(ctx.option("pin", 1, int)), ctx.option("proxy_cpus", ""),
                                         starting_engine=not upstream)
    server = proxy_proc = None
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    summary: dict = {}
    affinity = os.sched_getaffinity(0)
    try:
        if not upstream:
            tick("starting vLLM")
            server = VLLMServer(VLLMServerConfig(model_dir=model_dir, block_size=block, cpus=engine_cpus,
                                                 log_file=logs / "bench-proxy-vllm.log")).start()
            upstream = server.url
        model = served_model(upstream)
        proxy_proc = proxy_process(  # the trace's tenants are named by the client: an open proxy on loopback
            upstream=upstream, model=ctx.config.model, cache_dir=ctx.config.cache_dir,
            log_file=logs / "bench-proxy.log", args=["--block-size", str(block), "--allow-client-tenant"],
            cpus=proxy_cpus)
        proxy_proc.launch()
        if proxy_cpus:
            os.sched_setaffinity(0, proxy_cpus)  # the load generator shares the proxy's core, not the engine's
        proxy_proc.wait()
        target = _Target(upstream, proxy_proc.url, model, proxy_proc.pid, logs / "bench-proxy.log", max_tokens)
        questions = [r.question for r in requests]
        questions = (questions * (per_level // max(1, len(questions)) + 1))[:per_level]
        tick(total=len(levels) + repeats + 1 + bool(control))
        errors = _overhead_phase(ctx, tick, target, questions, rows, summary)
        errors += _docs_phase(target, requests, renderer, rows, summary)
        tick("documents")
        if soak_s > 0:
            errors += _soak_phase(target, questions, soak_s, rows, summary)
        tick("soak")
        summary["errors"] = errors
        summary["requests"] = len(requests)
    finally:
        os.sched_setaffinity(0, affinity)
        if proxy_proc is not None:
            proxy_proc.stop(30)
        if server is not None:
            server.stop()
    config = {"concurrency": levels, "requests_per_level": per_level, "max_tokens": max_tokens, "soak_s": soak_s,
              "repeats_at_top": repeats, "client_nice": client_nice,
              "documents_requests": len(requests), "upstream": ctx.option("upstream", "") or "started by the bench",
              "engine_cpus": list(engine_cpus) or "all", "proxy_and_client_cpus": list(proxy_cpus) or "all",
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

