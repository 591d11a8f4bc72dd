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
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile
from contextkit.bench.ordering import TraceRenderer, load_stream
from contextkit.errors import ConfigError
from contextkit.integrations.vllm_server import (
    VLLMServer, VLLMServerConfig, free_port, reset_prefix_cache, served_model, wait_for_health,
)  # fmt: skip
from contextkit.models import prepare
from contextkit.tokenizer import Tokenizer


async def _ttft(session: aiohttp.ClientSession, url: str, body: dict, rid: str | None = None) -> tuple[float, bool]:
    """(ms to the first content chunk, ok) of one streaming request; ``rid`` goes out as ``x-request-id``
    (the proxy logs its own timings under it)."""
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body, headers={"x-request-id": rid} if rid else None) as r:
            if r.status != 200:
                await r.read()
                return (time.perf_counter() - t0) * 1e3, False
            first = None
            async for line in r.content:
                if first is None and line.startswith(b"data:") and b'"choices":[{' in line.replace(b" ", b""):
                    first = time.perf_counter()
            return ((first or time.perf_counter()) - t0) * 1e3, True
    except (aiohttp.ClientError, TimeoutError):
        return (time.perf_counter() - t0) * 1e3, False


def _session(connections: int) -> aiohttp.ClientSession:
    # aiohttp, like the proxy: httpx's pool costs O(connections) per event, which at 64 streams made
    # the load generator itself a CPU hog competing with what it measures
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections),
                                 timeout=aiohttp.ClientTimeout(total=600))


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _proxy_timings(log: Path, offset: int) -> dict[str, dict]:
    """The proxy's access-log records (JSON lines) written after ``offset``, by request id."""
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
    return out


async def _overhead(a: str, b: str, model: str, questions: list[str], conc: int, max_tokens: int):
    """Each request sent to ``a`` and to ``b`` back to back (alternating which goes first, each with its
    own ``cache_salt``). Returns the (a, b) TTFT pairs, errors, and b's TTFT by request id."""
    async with _session(conc * 2 + 8) as session:
        work = list(enumerate(questions))
        pairs, errors, by_id = [], 0, {}

        async def worker() -> None:
            nonlocal errors
            while work:
                i, q = work.pop()
                body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True}
                # back to back, alternating which goes first (sending both at once makes the second
                # arrival wait one engine step on a CPU server: that measured vLLM, not the proxy)
                got = [None, None]
                for arm in ((0, 1) if i % 2 else (1, 0)):
                    rid = uuid.uuid4().hex
                    got[arm] = await _ttft(session, (a, b)[arm] + "/v1/chat/completions",
                                           {**body, "cache_salt": uuid.uuid4().hex}, rid)
                    if arm == 1 and got[1][1]:
                        by_id[rid] = got[1][0]
                if got[0][1] and got[1][1]:
                    pairs.append((got[0][0], got[1][0]))
                else:
                    errors += 1

        await asyncio.gather(*(worker() for _ in range(conc)))
    return pairs, errors, by_id


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
            rss["start"] = _rss_kb(pid)
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
            rss["end"] = _rss_kb(pid)

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


def _split_cpus(option: str, starting_engine: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(engine cores, proxy + client cores). Default: when the bench starts vLLM on a machine with >= 2
    cores, the engine gets all but the last and the proxy and the load generator the last, as a proxy in
    front of a GPU server has a core of its own; ``--set pin=0`` shares all cores."""
    have = sorted(os.sched_getaffinity(0))
    if option in ("0", "no", "false") or not starting_engine or len(have) < 2:
        return (), ()
    return tuple(have[:-1]), (have[-1],)


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


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    levels = [int(c) for c in ctx.option("concurrency", "1,16,64").split(",")]
    per_level = ctx.option("requests_per_level", 128, int)
    max_tokens = ctx.option("max_tokens", 8, int)
    soak_s = ctx.option("soak_s", 0.0, float)
    block = ctx.option("block_size", 32, int)
    control = ctx.option("control", 1, int)
    requests = load_stream(ctx, ctx.option("k", 10, int))
    model_dir = prepare(ctx.config.model, ctx.config.cache_dir)
    renderer = TraceRenderer(Tokenizer(model_dir), block)
    upstream = ctx.option("upstream", "")
    engine_cpus, proxy_cpus = _split_cpus(ctx.option("pin", "1"), starting_engine=not upstream)
    server = proxy_proc = None
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    proxy_log = logs / "bench-proxy.log"
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
        port = free_port()
        pin = ["taskset", "-c", ",".join(map(str, proxy_cpus))] if proxy_cpus else []
        exe = [*pin, sys.executable, "-m", "contextkit.cli", "proxy", "--upstream", upstream, "--port", str(port),
               "--block-size", str(block), "--model", ctx.config.model]
        env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(ctx.config.cache_dir))
        with open(proxy_log, "ab") as log:
            proxy_proc = subprocess.Popen(exe, stdout=log, stderr=subprocess.STDOUT, env=env)
        if proxy_cpus:
            os.sched_setaffinity(0, proxy_cpus)  # the load generator shares the proxy's core, not the engine's
        proxy = f"http://127.0.0.1:{port}"
        wait_for_health(proxy, 120)
        questions = [r.question for r in requests]
        questions = (questions * (per_level // max(1, len(questions)) + 1))[:per_level]
        tick(total=len(levels) + 2 + bool(control))
        errors = 0
        for conc in levels:
            offset, cpu0 = proxy_log.stat().st_size, _cpu_s(proxy_proc.pid)
            pairs, errs, by_id = asyncio.run(_overhead(upstream, proxy, model, questions, conc, max_tokens))
            cpu_ms = round((_cpu_s(proxy_proc.pid) - cpu0) * 1e3 / max(1, len(by_id)), 3)
            errors += errs
            if not pairs:
                raise ConfigError(f"no request succeeded at concurrency {conc}; see {logs}")
            rows.append(_overhead_row("overhead", conc, pairs, errs, by_id, _proxy_timings(proxy_log, offset), cpu_ms))
            tick(f"overhead at {conc}")
        top = rows[-1]
        if control:  # the paired estimator on direct vs direct: its spread is the engine's, not the proxy's
            pairs, errs, _ = asyncio.run(_overhead(upstream, upstream, model, questions, levels[-1], max_tokens))
            rows.append(_overhead_row("A/A control", levels[-1], pairs, errs, {}, {}, None))
            summary["control_paired_overhead_ms_p99"] = rows[-1]["paired_overhead_ms_p99"]
            tick("control")
        summary.update({k: top[k] for k in ("overhead_ms_p50", "overhead_ms_p99", "paired_overhead_ms_p50",
                                            "paired_overhead_ms_p99", "proxy_ms_p50", "proxy_ms_p99",
                                            "proxy_cpu_ms_per_request")},
                       overhead_at_concurrency=top["concurrency"])
        docs = asyncio.run(_docs(upstream, proxy, model, requests, renderer, max_tokens))
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
        os.sched_setaffinity(0, affinity)
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

