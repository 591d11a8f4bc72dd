"""The proxy's ASGI application: routing, metrics, the access log, and ``serve``.

Every endpoint the upstream serves passes through unchanged (everything under ``/v1/``: models,
completions, chat completions with and without ``stream``; ``/tokenize``, ``/detokenize``, ``/version``)
on the raw relay (``relay.Upstreams.passthrough``: no framework work per chunk, which is what the
proxy's latency under 64 streams was made of). A chat request carrying ``documents`` or ``contextkit``
goes to the documents route (``documents.py``). ``/health`` and ``/metrics`` are ours; any other path is
an OpenAI 404. Errors are OpenAI error objects with the status ``contextkit.core.errors.http_status``
gives: 400/413/422 for the request, 502 (upstream failed), 503 (no upstream), 504 (upstream too slow).

The access log is one JSON line per request: the client's ``x-request-id``, status, and where the time
went: ``proxy_ms`` (arrival to forwarding upstream: ours), ``upstream_ttft_ms`` (forwarding to the
upstream's first body bytes: the server's), ``ms_total``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from types import SimpleNamespace

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from contextkit.core.errors import (
    BodyTooLargeError,
    ContextKitError,
    PromptTooLongError,
    http_status,
)
from contextkit.core.models import resolve_model_dir
from contextkit.core.planner import Planner
from contextkit.core.tenancy import Tenancy, check_bind, deployment_secret, load_api_keys
from contextkit.core.tokenizer import Tokenizer
from contextkit.integrations.edge.answers import error_body, error_headers
from contextkit.integrations.edge.metrics import CONTENT_TYPE, ServerMetrics, check_metrics_access, route_label
from contextkit.integrations.edge.parse import ClientGone, json_body, read_body
from contextkit.integrations.edge.ratelimit import RateLimit, RateLimiter
from contextkit.integrations.proxy.documents import documents
from contextkit.integrations.proxy.exchange import Exchange
from contextkit.integrations.proxy.planning import Planning
from contextkit.integrations.proxy.relay import (
    Upstreams,
    client_request_id,
    describe,
    send_json,
    upstream_request_id,
)
from contextkit.integrations.proxy.reuse_paths import Prompts
from contextkit.integrations.proxy.routes import (
    cap_fan_out,
    check_json,
    longest_ids_prompt,
    not_found_message,
    route_of,
    salt_body,
    strip_connector_fields,
)
from contextkit.integrations.proxy.routing import Routed, Router, render_keys, session_key
from contextkit.integrations.proxy.settings import ProxySettings
from contextkit.integrations.proxy.upstreams import UpstreamPool
from contextkit.integrations.vllm_connector.cacheblend import refuse_unasked_blend

log = logging.getLogger("contextkit.proxy")
PARSE_ON_LOOP = 256 << 10  # bytes: a body smaller than this is parsed on the event loop
# values a body may hold besides one context of token ids (``max_json_values``' default), and the context
# assumed while no upstream has said its own
OTHER_VALUES, UNKNOWN_CONTEXT = 65_536, 262_144


def tenancy_of(settings: ProxySettings, reuse: Prompts) -> Tenancy:
    """The proxy's tenancy: its API keys and the secret its cache salts derive from, checked against what
    ``reuse`` (the upstreams' reuse path) needs of a deployment."""
    secret = deployment_secret(settings.cache_dir, settings.secret, settings.secret_file)
    keys = load_api_keys(settings.api_keys_file, settings.api_keys)
    reuse.check_deployment(settings, keys)
    return Tenancy(keys, secret, settings.allow_client_tenant)


class ProxyMetrics(ServerMetrics):
    """Requests and TTFT, plus prompt tokens served from the upstreams' caches and reorder decisions."""

    def __init__(self):
        super().__init__("contextkit_proxy")
        self.prompt_tokens = Counter("contextkit_proxy_prompt_tokens", "prompt tokens of documents requests",
                                     registry=self.registry)
        self.cached_tokens = Counter("contextkit_proxy_cached_prompt_tokens",
                                     "prompt tokens the upstream served from its prefix cache", registry=self.registry)
        self.reorders = Counter("contextkit_proxy_reorder_decisions", "documents requests reordered or kept",
                                ("decision",), registry=self.registry)
        self.stripped = Counter("contextkit_proxy_stripped_fields", "client body fields removed before "
                                "forwarding (they would reach vLLM's KV connectors)", ("field",),
                                registry=self.registry)
        self.searches = Counter("contextkit_proxy_event_order_searches", "documents requests ordered by the fleet's "
                                "KV events, by outcome (found, none, cut: a limit ended the search)", ("outcome",),
                                registry=self.registry)
        self.search_scores = Counter("contextkit_proxy_event_order_scores", "candidate documents scored by those "
                                     "searches", registry=self.registry)

    def event_order(self, search) -> None:
        self.searches.labels(search.outcome).inc()
        self.search_scores.inc(search.scores)

    def usage(self, usage: dict | None) -> None:
        if usage:
            self.prompt_tokens.inc(int(usage.get("prompt_tokens") or 0))
            self.cached_tokens.inc(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))


class PoolCollector:
    """The upstream pool's state, read at scrape time: routing decisions, health, requests in flight, and
    each upstream's KV events (whether its index is fresh, the blocks it holds, what its feed counted)."""

    def __init__(self, pool: UpstreamPool, router: Router):
        self.pool, self.router = pool, router

    def describe(self):
        return []

    def collect(self):
        routing = CounterMetricFamily("contextkit_proxy_routing_decisions", "generation requests placed, by rule "
                                      "(events, model, affinity, least_loaded; overloaded: a cache passed "
                                      "over for load)", labels=["rule"])
        for rule, n in self.router.decisions.items():
            routing.add_metric([rule], n)
        healthy = GaugeMetricFamily("contextkit_proxy_upstream_healthy", "1 if in rotation", labels=["upstream"])
        inflight = GaugeMetricFamily("contextkit_proxy_upstream_inflight", "requests in flight", labels=["upstream"])
        fresh = GaugeMetricFamily("contextkit_proxy_upstream_events_fresh", "1: routed by its KV events; 0: it "
                                  "publishes none, or they went stale (routed by the fallback)", labels=["upstream"])
        blocks = GaugeMetricFamily("contextkit_proxy_upstream_indexed_blocks", "blocks its KV events say it holds",
                                   labels=["upstream"])
        events = CounterMetricFamily("contextkit_proxy_kv_events", "its KV event feed: batches, gaps, replays, "
                                     "restarts, malformed, blocks stored/removed/refused...",
                                     labels=["upstream", "kind"])
        for i, u in enumerate(self.pool.upstreams):
            healthy.add_metric([u.url], int(u.healthy))
            inflight.add_metric([u.url], u.inflight)
            fresh.add_metric([u.url], int(self.router.fresh(i)))
            view = self.router.views[i]
            if view is not None:
                blocks.add_metric([u.url], len(view.index))
                for kind, n in (view.feed.counts + view.index.counts).items():
                    events.add_metric([u.url, kind], n)
        yield from (routing, healthy, inflight, fresh, blocks, events)


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event (a dict logged as it is, or the message)."""

    def format(self, record: logging.LogRecord) -> str:
        event = record.msg if isinstance(record.msg, dict) and not record.args else record.getMessage()
        return json.dumps({"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                           "event": event})


class ProxyApp:
    """The ASGI application (``uvicorn`` serves it; tests run it in a thread)."""

    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self.metrics = ProxyMetrics()
        self.upstreams = Upstreams(settings, self.metrics)
        self.metrics.registry.register(PoolCollector(self.upstreams.pool, self.upstreams.router))
        self.tenancy = tenancy_of(settings, self.upstreams.reuse)
        self.limiter = RateLimiter(RateLimit(settings.rate_per_s, settings.rate_burst))
        self.state = SimpleNamespace(pool=self.upstreams.pool, metrics=self.metrics, settings=settings,
                                     tenancy=self.tenancy)
        self._planner: Planner | None = None
        self._no_tokenizer = False
        self._tasks: list[asyncio.Task] = []
        # CPU work off the loop (planning.py): plannings and large bodies, shared fairly by tenants; and
        # routing's key rendering for pass-through requests on a thread of its own, never behind a planning
        self.planning = Planning()
        self.routing = Planning(1, name="contextkit-route")

    def planner(self) -> Planner:
        """The planner on the upstream model's tokenizer (loaded on the first documents request)."""
        if self._planner is None:
            s = self.settings
            tokenizer = Tokenizer(resolve_model_dir(s.model, s.cache_dir))
            self._planner = Planner(tokenizer, block_size=s.block_size)
        return self._planner

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return None
        # the id vLLM keys the request by is the proxy's, never a client's (one tenant guessing another's
        # would share its abort and its log lines); the client's own goes to the access log and back to it
        t = Exchange(upstream_request_id(), client_request_id(scope["headers"]))
        route = scope["path"]
        try:
            await self.handle(scope, receive, send, t)
        except ClientGone:
            if t.status is None:
                t.status = 499
        except Exception as exc:  # noqa: BLE001 - every failure answers an OpenAI error, whatever it was
            if not isinstance(exc, ContextKitError):
                log.exception("proxy error")
            if t.status is None:  # nothing sent yet
                headers = [(k.encode(), v.encode()) for k, v in error_headers(exc).items()]
                await send_json(send, t, http_status(exc), error_body(exc, message=_message(exc)), headers)
            elif http_status(exc) >= 500:
                log.warning({"route": route, "error": describe(exc)})
        finally:
            if t.documents:
                route = "chat_documents"
            self.metrics.request(route, t.status or 0)
            self.log(scope, t)

    async def handle(self, scope, receive, send, t: Exchange) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/health":
            if self.upstreams.pool.healthy():
                return await send_json(send, t, 200, {"status": "ok"})
            return await send_json(send, t, 503, error_body(503, "no healthy upstream"))
        if path == "/metrics":
            self.metrics_access(scope)
            body = self.metrics.text()
            t.status = 200
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", CONTENT_TYPE.encode())]})
            return await send({"type": "http.response.body", "body": body})
        route, routed = route_of(method, path), None
        if route is None:
            return await send_json(send, t, 404, error_body(404, not_found_message(method, path)))
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        tenant = self.tenancy.authenticate(auth)  # 401 before anything else is read
        self.limiter.check(tenant)  # and 429 over the tenant's rate
        body = None
        if route.has_body:
            check_json(scope["headers"])  # 400 for two Content-Types, 415 for a body that is not JSON
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            raw = await read_body(receive, self.settings.max_body_bytes, declared)
            # a large body is parsed off the loop too (8 MiB took ~0.3 s on this 2-core machine, every stream
            # relayed meanwhile would wait); a small one costs less than the hop to a thread
            large = len(raw) >= PARSE_ON_LOOP
            if large:
                await self.refuse_many_values(raw)
            parsed = await self.planning.run(json_body, raw, owner=tenant.name) if large else json_body(raw)
            for name in strip_connector_fields(parsed):
                self.metrics.stripped.labels(name).inc()
            if "request_id" in parsed:  # vLLM would key the request by it: the proxy's id replaces it
                parsed["request_id"] = t.request_id
            if route.generates:
                cap_fan_out(path, parsed, self.settings.max_n)  # by value: "64" and 64.0 count as 64
                await self.refuse_past_context(path, parsed)
                if path == "/v1/chat/completions" and ("documents" in parsed or "skills" in parsed
                                                      or "contextkit" in parsed):
                    t.documents = True
                    return await documents(self.upstreams, self.planner(), self.tenancy, tenant, scope, receive,
                                           send, parsed, t, planning=self.planning)
                if self.upstreams.reuse.guards_prompts:
                    await self.planning.run(self.refuse_blend, parsed, owner=tenant.name)
                salt_body(route, parsed, lambda own: self.tenancy.cache_salt(tenant, own))
                routed = await self.place(path, parsed)
            # what was checked is what is sent (a large body serialized off the loop, as it was parsed)
            body = await self.planning.run(_encode, parsed, owner=tenant.name) if large else _encode(parsed)
        await self.upstreams.passthrough(scope, receive, send, route, body, t, routed)

    async def largest_context(self) -> int | None:
        """The largest ``max_model_len`` of the healthy upstreams (None while none has said)."""
        limits = [m for m in await asyncio.gather(*(self.upstreams.model_len(u) for u in self.upstreams.pool.healthy()))
                  if m]
        return max(limits) if limits else None

    async def refuse_many_values(self, raw: bytes) -> None:
        """A body of more JSON values than any request that fits the upstreams needs is refused (413) before it
        is parsed. Parsing 1M token ids holds the interpreter ~0.3 s on whatever thread runs it (the parser
        keeps the GIL), and every stream the proxy relays waits meanwhile; counting commas takes ~3 ms for
        8 MiB. A comma in a string counts too: text that fits a context has fewer commas than tokens."""
        cap = self.settings.max_json_values
        if cap is None:
            cap = (await self.largest_context() or UNKNOWN_CONTEXT) + OTHER_VALUES
        n = raw.count(b",") + 1
        if n > cap:
            raise BodyTooLargeError(f"the body holds about {n} JSON values, over this proxy's limit of {cap} (one "
                                    "context of token ids and the rest): send fewer or shorter prompts per request, "
                                    "or raise the proxy's max_json_values")

    async def refuse_past_context(self, path: str, body: dict) -> None:
        """A token-id prompt longer than every healthy upstream's context is refused here (413), not parsed
        again and refused by vLLM: a megabyte-sized prompt costs vLLM's server the CPU its engine needs."""
        n = longest_ids_prompt(path, body)
        if not n:
            return
        limit = await self.largest_context()
        if limit and n > limit:
            raise PromptTooLongError(f"a prompt of {n} token ids is over the upstreams' context of {limit} "
                                     "tokens; shorten it", "prompt")

    async def place(self, path: str, body: dict) -> Routed | None:
        """Choose the upstream for a salted generation request (``routing.Router``); None: one upstream."""
        pool = self.upstreams.pool.healthy()
        if len(pool) < 2:
            return None
        router, salt = self.upstreams.router, body.get("cache_salt")
        keys: tuple[bytes, ...] = ()
        if router.publishing and await self.route_tokenizer() is not None:
            keys = await self.routing.run(render_keys, path, body, self._planner.tokenizer,
                                          block_size=self.settings.block_size, salt=salt)
        choice = router.pick(pool, events=router.held(keys), session=session_key(body, salt), blocks=len(keys))
        return Routed(choice, keys)

    async def route_tokenizer(self):
        """The upstream model's tokenizer for scoring prompts, loaded once off the loop; None (logged once)
        when the proxy cannot load it: requests are then placed without a cache score."""
        if self._planner is None and not self._no_tokenizer:
            try:
                await self.routing.run(self.planner)
            except (ContextKitError, OSError) as exc:
                self._no_tokenizer = True
                log.warning({"event": "routing without prompt scores", "why": str(exc)})
        return None if self._planner is None else self._planner.tokenizer

    def metrics_access(self, scope) -> None:
        """``/metrics``: the metrics key's holder, or on an open proxy loopback peers (``check_metrics_access``)."""
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        check_metrics_access(key=self.settings.metrics_key, keyed=not self.tenancy.open, authorization=auth,
                             client=(scope.get("client") or ("",))[0])

    def refuse_blend(self, body: dict) -> None:
        """A CacheBlend upstream blends any prompt holding its separator: refuse one that did not opt in
        (it tokenizes the body's strings: run on a planning thread)."""
        tokenizer = self.planner().tokenizer
        refuse_unasked_blend(body=body, separator=self.settings.cacheblend_separator,
                             separator_ids=self.upstreams.blend_separator(tokenizer),
                             encode=lambda text: tokenizer.encode(text, add_special_tokens=False))

    async def lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.upstreams.open()
                pool, interval = self.upstreams.pool, self.settings.health_interval_s
                self._tasks.append(asyncio.create_task(pool.watch(self.upstreams.session, interval)))
                if self.upstreams.router.publishing:
                    self._tasks.append(asyncio.create_task(self.upstreams.router.run()))
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                for task in self._tasks:
                    task.cancel()
                self.planning.close()
                self.routing.close()
                await self.upstreams.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    @staticmethod
    def log(scope, t: Exchange) -> None:
        fwd, first = t.forwarded, t.upstream_first
        log.info({"method": scope["method"], "path": route_label(scope["path"]), "status": t.status,
                  "request_id": t.client_request_id, "upstream_request_id": t.request_id,
                  "proxy_ms": round(t.proxy_ms(), 3) if fwd is not None else None,
                  "upstream_ttft_ms": round((first - fwd) * 1e3, 3) if fwd and first else None,
                  "ms_total": round((time.perf_counter() - t.t0) * 1e3, 3)})


def _encode(body: dict) -> bytes:
    return json.dumps(body).encode()


def _message(exc: BaseException) -> str:
    # an unexpected error's text may name an upstream's address (the log has it whole): its type only
    return str(exc) if isinstance(exc, ContextKitError) else f"proxy error: {type(exc).__name__}"


def create_app(settings: ProxySettings) -> ProxyApp:
    """The ASGI application (``uvicorn`` serves it; tests run it in a thread)."""
    return ProxyApp(settings)


def serve(settings: ProxySettings) -> None:
    """Run the proxy with uvicorn until SIGINT/SIGTERM; in-flight streams get ``graceful_shutdown_s``."""
    import uvicorn

    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    app = create_app(settings)
    log.info({"event": "start", "tenancy": check_bind(app.tenancy, settings.host)})
    # Latency: what was imported and built at start never becomes garbage, so it leaves the collector's
    # generations (a full collection would walk all of it: aiohttp, pydantic, the tokenizer's tables),
    # and young collections run less often (a stall of ~120 ms across streams looked like one)
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 20, 20)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning",
                timeout_graceful_shutdown=int(settings.graceful_shutdown_s))
