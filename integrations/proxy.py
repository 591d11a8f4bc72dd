"""``contextkit proxy``: a drop-in OpenAI-compatible proxy in front of one or more vLLM servers.

Every endpoint the upstream serves passes through unchanged (``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` with and without ``stream``, ``/tokenize``, ``/detokenize``), streamed chunk
by chunk; a client that disconnects closes the upstream request. A chat request with ``documents``
(and optional ``contextkit`` options) is ordered by the weaver, rendered as stable token segments,
sent with the tenant as ``cache_salt`` to the upstream whose cache shares the longest prefix with it,
and answered as a chat completion carrying a ``contextkit`` field (the order, what was reordered, the
prompt tokens served from cache). Errors are OpenAI error objects with the status that says whose fault
it is: 400/413/422 for the request, 502 (upstream failed), 503 (no upstream), 504 (upstream too slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import httpx
from fastapi import FastAPI, Request  # module level: route signatures are resolved from module globals
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic_settings import BaseSettings, JsonConfigSettingsSource, SettingsConfigDict

from contextkit.integrations.prom import Counter, Histogram
from contextkit.integrations.proxy_docs import (
    RequestError, Renderer, chat_chunk, chat_from_completion, completion_body, json_body, parse, sse,
)  # fmt: skip
from contextkit.integrations.upstreams import Upstream, UpstreamPool
from contextkit.ordering.weaver import Doc

log = logging.getLogger("contextkit.proxy")
HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding"}


class ProxySettings(BaseSettings):
    """Proxy configuration from flags, ``CONTEXTKIT_PROXY_*`` environment variables or a JSON/env file."""

    model_config = SettingsConfigDict(env_prefix="CONTEXTKIT_PROXY_", extra="forbid", frozen=True)

    upstreams: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout_s: float = 120.0  # an upstream slower than this (to first byte, or between chunks) gets 504
    connect_timeout_s: float = 5.0
    block_size: int = 32  # the upstream's KV block size (vLLM: 16 on GPU, 32 on CPU)
    model: str = "smollm2-135m-instruct"  # tokenizer used to render documents; must be the upstream's
    cache_dir: Path = Path("~/.cache/contextkit")
    health_interval_s: float = 5.0
    max_body_bytes: int = 32 << 20
    graceful_shutdown_s: float = 30.0


def load_settings(file: Path | None = None, **flags) -> ProxySettings:
    """Settings from flags, then ``CONTEXTKIT_PROXY_*`` environment variables, then a JSON file, then defaults."""

    class _Settings(ProxySettings):
        model_config = SettingsConfigDict(**{**ProxySettings.model_config, "json_file": file})

        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                       file_secret_settings):
            return (init_settings, env_settings, JsonConfigSettingsSource(settings_cls))

    return _Settings(**flags)


class Metrics:
    def __init__(self):
        self.requests = Counter("contextkit_proxy_requests_total", ("route", "status"))
        self.ttft = Histogram("contextkit_proxy_ttft_seconds")
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.reorders = {"reordered": 0, "kept": 0}

    def request(self, route: str, status: int) -> None:
        self.requests.inc(route, status)

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def usage(self, usage: dict | None) -> None:
        if usage:
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def text(self, pool: UpstreamPool) -> str:
        p = "contextkit_proxy"
        out = self.requests.lines() + self.ttft.lines()
        out += [f"# TYPE {p}_prompt_tokens_total counter", f"{p}_prompt_tokens_total {self.prompt_tokens}",
                f"# TYPE {p}_cached_prompt_tokens_total counter", f"{p}_cached_prompt_tokens_total {self.cached_tokens}",
                f"# TYPE {p}_reorder_decisions_total counter"]
        out += [f'{p}_reorder_decisions_total{{decision="{k}"}} {v}' for k, v in self.reorders.items()]
        out.append(f"# TYPE {p}_routing_decisions_total counter")
        out += [f'{p}_routing_decisions_total{{rule="{k}"}} {v}' for k, v in pool.routing.items()]
        out.append(f"# TYPE {p}_upstream_healthy gauge")
        out += [f'{p}_upstream_healthy{{upstream="{u.url}"}} {int(u.healthy)}' for u in pool.upstreams]
        out.append(f"# TYPE {p}_upstream_inflight gauge")
        out += [f'{p}_upstream_inflight{{upstream="{u.url}"}} {u.inflight}' for u in pool.upstreams]
        return "\n".join(out) + "\n"


class AccessLog:
    """Pure ASGI middleware (no body buffering, unlike ``BaseHTTPMiddleware``): stamps the arrival time
    for the handlers (``scope["state"]["t0"]``) and logs one JSON line per request when it ends."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        scope.setdefault("state", {})["t0"] = t0
        status = {}

        async def capture(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                status["ms_to_headers"] = round((time.perf_counter() - t0) * 1e3, 3)
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            log.info(json.dumps({"method": scope["method"], "path": scope["path"], "status": status.get("code"),
                                 "ms_to_headers": status.get("ms_to_headers"),
                                 "ms_total": round((time.perf_counter() - t0) * 1e3, 3)}))


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event (the message, parsed when it is JSON)."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        try:
            event = json.loads(msg)
        except ValueError:
            event = msg
        return json.dumps({"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                           "event": event})


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
            422: "invalid_request_error", 502: "upstream_error", 503: "service_unavailable",
            504: "timeout"}.get(status, "api_error")  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def create_app(settings: ProxySettings):
    """The FastAPI application (``uvicorn`` serves it; tests drive it directly)."""
    pool = UpstreamPool(settings.upstreams, settings.block_size)
    metrics = Metrics()
    state: dict = {}

    def fail(status: int, message: str, param: str | None = None, route: str = "") -> JSONResponse:
        metrics.request(route, status)
        if status >= 500:
            log.warning(json.dumps({"route": route, "status": status, "error": message}))
        return JSONResponse(error_body(status, message, param), status_code=status)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        timeout = httpx.Timeout(settings.timeout_s, connect=settings.connect_timeout_s)
        state["client"] = httpx.AsyncClient(timeout=timeout, limits=limits)
        await pool.check(state["client"])
        watcher = asyncio.create_task(pool.watch(state["client"], settings.health_interval_s))
        try:
            yield
        finally:
            watcher.cancel()
            await state["client"].aclose()

    app = FastAPI(title="contextkit proxy", lifespan=lifespan)
    app.state.pool, app.state.metrics, app.state.settings = pool, metrics, settings

    app.add_middleware(AccessLog)

    def renderer() -> Renderer:
        if "renderer" not in state:
            from contextkit.config import ContextKitConfig
            from contextkit.kit import resolve_model_dir
            from contextkit.tokenizer import Tokenizer

            cfg = ContextKitConfig(model=settings.model, cache_dir=settings.cache_dir)
            state["renderer"] = Renderer(Tokenizer(resolve_model_dir(cfg, None)), settings.block_size)
        return state["renderer"]

    async def body_json(request: Request) -> dict:
        return json_body(await request.body(), settings.max_body_bytes)

    async def open_upstream(u: Upstream, method: str, path: str, request: Request | None, content: bytes | None):
        headers = {k: v for k, v in (request.headers.items() if request else ()) if k.lower() not in HOP}
        headers["content-type"] = "application/json"
        req = state["client"].build_request(method, u.url + path, content=content, headers=headers,
                                            params=request.query_params if request else None)
        try:
            resp = await state["client"].send(req, stream=True)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
            # a pooled keep-alive connection the server had just closed: the request never reached it,
            # so one retry on a fresh connection is safe (and is what every production proxy does)
            resp = await state["client"].send(req, stream=True)
        u.consecutive_failures = 0
        return resp

    def upstream_failure(u: Upstream, exc: Exception, route: str) -> JSONResponse:
        if isinstance(exc, httpx.TimeoutException):
            return fail(504, f"upstream {u.url} did not answer within {settings.timeout_s:.0f} s; raise "
                             "--timeout-s or check the server's load", route=route)
        pool.mark_failed(u)
        return fail(502, f"upstream {u.url} failed: {type(exc).__name__}: {exc}; it is out of rotation until "
                         "its /health answers", route=route)

    async def relay(u: Upstream, resp: httpx.Response, route: str, t0: float):
        """Forward the upstream's bytes as they come; closing the client side closes the upstream."""
        first = True
        try:
            async for chunk in resp.aiter_raw():
                if first:
                    metrics.first_token(time.perf_counter() - t0)
                    first = False
                yield chunk
        except httpx.HTTPError as exc:  # mid-stream failure: tell the client in the stream, then end it
            yield sse(error_body(502, f"upstream {u.url} failed mid-stream: {exc}"))
        finally:
            await resp.aclose()
            u.inflight -= 1

    async def start(u: Upstream, method: str, path: str, request: Request | None, body: bytes | None, route: str):
        """Open a request to ``u`` counting it in flight; a connection failure or a 5xx answer becomes our
        502/504 (and releases the slot). Returns the open response or the error to send."""
        u.inflight += 1
        u.requests += 1
        try:
            resp = await open_upstream(u, method, path, request, body)
        except httpx.HTTPError as exc:
            u.inflight -= 1
            return upstream_failure(u, exc, route)
        if resp.status_code >= 500:
            text = (await resp.aread()).decode(errors="replace")[:500]
            await resp.aclose()
            u.inflight -= 1
            return fail(502, f"upstream {u.url} answered {resp.status_code}: {text}", route=route)
        return resp

    async def passthrough(request: Request, method: str, path: str, route: str, body: bytes | None = None):
        u = pool.least_loaded()
        if u is None:
            return fail(503, "no healthy upstream; check the vLLM servers' /health", route=route)
        t0 = time.perf_counter()
        added_ms = (t0 - request.scope.get("state", {}).get("t0", t0)) * 1e3  # ours, before forwarding
        resp = await start(u, method, path, request, body, route)
        if isinstance(resp, Response):
            return resp
        metrics.request(route, resp.status_code)
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
        headers["x-contextkit-proxy-ms"] = f"{added_ms:.3f}"
        if "text/event-stream" in resp.headers.get("content-type", ""):
            return StreamingResponse(relay(u, resp, route, t0), status_code=resp.status_code, headers=headers)
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            return upstream_failure(u, exc, route)
        finally:
            await resp.aclose()
            u.inflight -= 1
        metrics.first_token(time.perf_counter() - t0)
        return Response(content, status_code=resp.status_code, headers=headers)

    async def documents(request: Request, body: dict):
        route = "chat_documents"
        req = parse(body)
        rend = renderer()
        lengths = [len(rend.doc_ids(d)) for d in req.documents]
        bs = settings.block_size if req.block_align else 1
        docs = [Doc(d.id or str(i), n + (-n % bs)) for i, (d, n) in enumerate(zip(req.documents, lengths))]
        u, result = pool.route(docs, req.tenant, reorder=req.ordering == "weaver")
        if u is None:
            return fail(503, "no healthy upstream; check the vLLM servers' /health", route=route)
        order = result.order if result else tuple(range(len(docs)))
        prompt, padding = rend.ids(req.messages, req.documents, order, req.block_align)
        metrics.reorders["reordered" if order != tuple(range(len(docs))) else "kept"] += 1
        limit = await model_len(u)
        want = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if limit and len(prompt) + want > limit:
            return fail(413, f"the rendered prompt is {len(prompt)} tokens plus {want} to generate, over the "
                             f"model's context of {limit}; send fewer or shorter documents or lower max_tokens",
                        "documents", route)
        ext = {"order": [req.documents[i].id for i in order], "reordered": order != tuple(range(len(docs))),
               "expected_cached_tokens": result.reusable_tokens if result else None, "upstream": u.url,
               "tenant": req.tenant, "padding_tokens": padding, "prompt_tokens": len(prompt)}
        payload = json.dumps(completion_body(body, prompt, req.tenant)).encode()
        t0 = time.perf_counter()
        resp = await start(u, "POST", "/v1/completions", None, payload, route)
        if isinstance(resp, Response):
            return resp
        if resp.status_code != 200:  # the upstream refused the request: its own error, as it is
            text = (await resp.aread()).decode(errors="replace")[:500]
            await resp.aclose()
            u.inflight -= 1
            metrics.request(route, resp.status_code)
            return Response(text, status_code=resp.status_code, media_type="application/json")
        metrics.request(route, 200)
        if body.get("stream"):
            return StreamingResponse(translate(u, resp, ext, t0), media_type="text/event-stream")
        try:
            obj = json.loads(await resp.aread())
        except (httpx.HTTPError, ValueError) as exc:
            return upstream_failure(u, exc, route)
        finally:
            await resp.aclose()
            u.inflight -= 1
        metrics.first_token(time.perf_counter() - t0)
        metrics.usage(obj.get("usage"))
        return JSONResponse(chat_from_completion(obj, ext))

    async def translate(u: Upstream, resp: httpx.Response, ext: dict, t0: float):
        seen: set[int] = set()
        first = True
        try:
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    yield sse("[DONE]")
                    break
                obj = json.loads(data)
                if first and obj.get("choices"):
                    metrics.first_token(time.perf_counter() - t0)
                    first = False
                metrics.usage(obj.get("usage"))
                yield sse(chat_chunk(obj, seen, ext))
        except (httpx.HTTPError, ValueError) as exc:
            yield sse(error_body(502, f"upstream {u.url} failed mid-stream: {exc}"))
        finally:
            await resp.aclose()
            u.inflight -= 1

    async def model_len(u: Upstream) -> int | None:
        """The upstream's context length from ``/v1/models``, asked once (a failed lookup is retried)."""
        if ("max_model_len", u.url) in state:
            return state[("max_model_len", u.url)]
        try:
            r = await state["client"].get(u.url + "/v1/models", timeout=settings.connect_timeout_s)
            n = int(r.json()["data"][0].get("max_model_len") or 0) or None
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            return None
        state[("max_model_len", u.url)] = n
        return n

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return fail(exc.status, str(exc), exc.param, route=request.url.path)

    @app.get("/health")
    async def health():
        if pool.healthy():
            return Response(status_code=200)
        return fail(503, "no healthy upstream", route="/health")

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(pool))

    @app.get("/v1/models")
    async def models(request: Request):
        return await passthrough(request, "GET", "/v1/models", "/v1/models")

    def forward_json(path: str):
        async def route(request: Request):
            await body_json(request)  # checked: malformed JSON gets a 400 here, not upstream
            return await passthrough(request, "POST", path, path, await request.body())  # the client's bytes

        return route

    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        app.add_api_route(path, forward_json(path), methods=["POST"])

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_json(request)
        if "documents" in body or "contextkit" in body:
            return await documents(request, body)
        return await passthrough(request, "POST", "/v1/chat/completions", "/v1/chat/completions",
                                 await request.body())

    return app


def serve(settings: ProxySettings) -> None:
    """Run the proxy with uvicorn until SIGINT/SIGTERM; in-flight streams get ``graceful_shutdown_s``."""
    import uvicorn

    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                timeout_graceful_shutdown=int(settings.graceful_shutdown_s))
