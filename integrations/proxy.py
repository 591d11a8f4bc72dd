"""``contextkit proxy``: a drop-in OpenAI-compatible proxy in front of one or more vLLM servers.

Every endpoint the upstream serves passes through unchanged (everything under ``/v1/``: models,
completions, chat completions with and without ``stream``; ``/tokenize``, ``/detokenize``, ``/version``),
streamed chunk by chunk; a client that disconnects closes the upstream request. A chat request with ``documents``
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
from typing import NamedTuple

import aiohttp
from fastapi import FastAPI, Request  # module level: route signatures are resolved from module globals
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic_settings import BaseSettings, JsonConfigSettingsSource, SettingsConfigDict

from contextkit.integrations.prom import Counter, Histogram
from contextkit.integrations.proxy_docs import (
    RequestError, Renderer, chat_chunk, chat_from_completion, completion_body, json_body, parse, sse,
)  # fmt: skip
from contextkit.integrations.upstreams import Upstream, UpstreamPool
from contextkit.ordering.weaver import Doc

log = logging.getLogger("contextkit.proxy")
HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "accept-encoding"}
HOP_B = {h.encode() for h in HOP}
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)  # what talking to an upstream can raise


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Failure(NamedTuple):
    """An error to answer with (an OpenAI error object with this status)."""

    status: int
    message: str
    param: str | None = None


def finish(u: Upstream, resp: aiohttp.ClientResponse, complete: bool) -> None:
    """Done with an upstream response: a fully read one gives its connection back to the pool; one left
    half-read (client gone, error) closes it, which tells vLLM to abort the request."""
    if complete:
        resp.release()
    else:
        resp.close()
    u.inflight -= 1


async def read_error(resp: aiohttp.ClientResponse) -> str:
    """The start of an upstream's error body (the response is closed afterwards)."""
    try:
        return (await resp.content.read(500)).decode(errors="replace")
    except UPSTREAM_ERRORS as exc:
        return describe(exc)
    finally:
        resp.close()


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


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, event (a dict logged as it is, or the message)."""

    def format(self, record: logging.LogRecord) -> str:
        event = record.msg if isinstance(record.msg, dict) and not record.args else record.getMessage()
        return json.dumps({"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                           "event": event})


def timing(request: Request) -> dict:
    """The request's timestamps (``t0`` set by ``ProxyApp`` at arrival; the handlers add theirs)."""
    t = request.scope.setdefault("state", {})
    t.setdefault("t0", time.perf_counter())
    return t


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
            422: "invalid_request_error", 502: "upstream_error", 503: "service_unavailable",
            504: "timeout"}.get(status, "api_error")  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class Proxy:
    """The proxy's state and its upstream I/O, shared by the raw pass-through relay and the FastAPI routes."""

    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self.pool = UpstreamPool(settings.upstreams, settings.block_size)
        self.metrics = Metrics()
        self.session: aiohttp.ClientSession | None = None
        self._renderer: Renderer | None = None
        self._model_len: dict[str, int | None] = {}

    async def open(self) -> None:
        # aiohttp, not httpx: httpx's connection pool rescans every pooled connection (a poll() each) on
        # every request and response event, which at 64 concurrent streams cost the proxy ~3 ms of CPU
        # per request (profiled); aiohttp hands out an idle connection in O(1) and parses in C
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(connect=self.settings.connect_timeout_s, sock_read=self.settings.timeout_s)
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))
        await self.pool.check(self.session)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def renderer(self) -> Renderer:
        if self._renderer is None:
            from contextkit.config import ContextKitConfig
            from contextkit.kit import resolve_model_dir
            from contextkit.tokenizer import Tokenizer

            cfg = ContextKitConfig(model=self.settings.model, cache_dir=self.settings.cache_dir)
            self._renderer = Renderer(Tokenizer(resolve_model_dir(cfg, None)), self.settings.block_size)
        return self._renderer

    def failure(self, status: int, message: str, param: str | None = None, route: str = "") -> Failure:
        self.metrics.request(route, status)
        if status >= 500:
            log.warning({"route": route, "status": status, "error": message})
        return Failure(status, message, param)

    def upstream_failure(self, u: Upstream, exc: BaseException, route: str) -> Failure:
        if isinstance(exc, TimeoutError):
            return self.failure(504, f"upstream {u.url} did not answer within {self.settings.timeout_s:.0f} s; "
                                     "raise --timeout-s or check the server's load", route=route)
        self.pool.mark_failed(u)
        return self.failure(502, f"upstream {u.url} failed: {describe(exc)}; it is out of rotation until its "
                                 "/health answers", route=route)

    async def start(self, u: Upstream, method: str, url: str, headers: dict, body: bytes | None, route: str,
                    timing: dict) -> aiohttp.ClientResponse | Failure:
        """Open a request to ``u`` counting it in flight; a connection failure or a 5xx answer becomes our
        502/504 (and releases the slot)."""
        timing["forwarded"] = time.perf_counter()
        u.inflight += 1
        u.requests += 1
        try:
            try:
                resp = await self.session.request(method, u.url + url, data=body, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):  # nothing listens: no retry
                    raise
                # a pooled keep-alive connection the server had just closed: the request never reached
                # it, so one retry on a fresh connection is safe (what every production proxy does)
                resp = await self.session.request(method, u.url + url, data=body, headers=headers)
        except UPSTREAM_ERRORS as exc:
            u.inflight -= 1
            return self.upstream_failure(u, exc, route)
        u.consecutive_failures = 0
        if resp.status >= 500:
            text = await read_error(resp)
            u.inflight -= 1
            return self.failure(502, f"upstream {u.url} answered {resp.status}: {text}", route=route)
        return resp

    def first_bytes(self, timing: dict) -> None:
        timing["upstream_first"] = now = time.perf_counter()
        self.metrics.first_token(now - timing["t0"])

    async def model_len(self, u: Upstream) -> int | None:
        """The upstream's context length from ``/v1/models``, asked once (a failed lookup is retried)."""
        if u.url in self._model_len:
            return self._model_len[u.url]
        try:
            timeout = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
            async with self.session.get(u.url + "/v1/models", timeout=timeout) as r:
                n = int((await r.json(content_type=None))["data"][0].get("max_model_len") or 0) or None
        except (*UPSTREAM_ERRORS, ValueError, KeyError, IndexError, TypeError):
            return None
        self._model_len[u.url] = n
        return n

    # -- pass-through: raw ASGI, no framework work per chunk ------------------------------------------

    async def passthrough(self, scope, receive, send, body: bytes | None, timing: dict) -> None:
        """Forward the request as it is to the least-loaded upstream and its answer as it comes."""
        route = scope["path"]
        u = self.pool.least_loaded()
        if u is None:
            return await send_failure(send, timing, self.failure(
                503, "no healthy upstream; check the vLLM servers' /health", route=route))
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k not in HOP_B}
        headers.setdefault("content-type", "application/json")
        url = route + ("?" + scope["query_string"].decode("latin-1") if scope.get("query_string") else "")
        resp = await self.start(u, scope["method"], url, headers, body, route, timing)
        if isinstance(resp, Failure):
            return await send_failure(send, timing, resp)
        self.metrics.request(route, resp.status)
        out = [(k, v) for k, v in resp.raw_headers if k.lower() not in HOP_B]
        out.append((b"x-contextkit-proxy-ms", b"%.3f" % ((timing["forwarded"] - timing["t0"]) * 1e3)))
        if "text/event-stream" in resp.headers.get("content-type", ""):
            return await self.relay(u, resp, receive, send, out, timing)
        done = False
        try:
            content = await resp.read()
            done = True
        except UPSTREAM_ERRORS as exc:
            return await send_failure(send, timing, self.upstream_failure(u, exc, route))
        finally:
            finish(u, resp, done)
        self.first_bytes(timing)
        out.append((b"content-length", str(len(content)).encode()))
        timing["status"] = resp.status
        await send({"type": "http.response.start", "status": resp.status, "headers": out})
        await send({"type": "http.response.body", "body": content})

    async def relay(self, u: Upstream, resp: aiohttp.ClientResponse, receive, send, headers: list, timing: dict):
        """Stream the upstream's bytes to the client as they arrive. A client that hangs up closes the
        upstream response (vLLM aborts the request); an upstream failing mid-stream gets an error event."""
        timing["status"] = resp.status
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        watcher = asyncio.ensure_future(close_on_disconnect(receive, resp))
        done = first = False
        try:
            async for chunk in resp.content.iter_any():
                if not first:
                    self.first_bytes(timing)
                    first = True
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            done = True
        except UPSTREAM_ERRORS as exc:
            if not watcher.done():  # the upstream failed, not the client
                event = sse(error_body(502, f"upstream {u.url} failed mid-stream: {describe(exc)}"))
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            watcher.cancel()
            finish(u, resp, done)
        await send({"type": "http.response.body", "body": b""})


def create_app(settings: ProxySettings) -> ProxyApp:
    """The ASGI application (``uvicorn`` serves it; tests run it in a thread)."""
    proxy = Proxy(settings)
    pool, metrics = proxy.pool, proxy.metrics

    def response(f: Failure) -> JSONResponse:
        return JSONResponse(error_body(f.status, f.message, f.param), status_code=f.status)

    def fail(status: int, message: str, param: str | None = None, route: str = "") -> JSONResponse:
        return response(proxy.failure(status, message, param, route))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await proxy.open()
        watcher = asyncio.create_task(pool.watch(proxy.session, settings.health_interval_s))
        try:
            yield
        finally:
            watcher.cancel()
            await proxy.close()

    api = FastAPI(title="contextkit proxy", lifespan=lifespan)
    api.state.pool, api.state.metrics, api.state.settings = pool, metrics, settings

    async def documents(request: Request, body: dict):
        route = "chat_documents"
        req = parse(body)
        rend = proxy.renderer()
        lengths = [len(rend.doc_ids(d)) for d in req.documents]
        bs = settings.block_size if req.block_align else 1
        docs = [Doc(d.id or str(i), n + (-n % bs)) for i, (d, n) in enumerate(zip(req.documents, lengths))]
        u, result = pool.route(docs, req.tenant, reorder=req.ordering == "weaver")
        if u is None:
            return fail(503, "no healthy upstream; check the vLLM servers' /health", route=route)
        order = result.order if result else tuple(range(len(docs)))
        reordered = order != tuple(range(len(docs)))
        prompt, padding = rend.ids(req.messages, req.documents, order, req.block_align)
        metrics.reorders["reordered" if reordered else "kept"] += 1
        limit = await proxy.model_len(u)
        want = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        if limit and len(prompt) + want > limit:
            return fail(413, f"the rendered prompt is {len(prompt)} tokens plus {want} to generate, over the "
                             f"model's context of {limit}; send fewer or shorter documents or lower max_tokens",
                        "documents", route)
        ext = {"order": [req.documents[i].id for i in order], "reordered": reordered,
               "expected_cached_tokens": result.reusable_tokens if result else None, "upstream": u.url,
               "tenant": req.tenant, "padding_tokens": padding, "prompt_tokens": len(prompt)}
        payload = json.dumps(completion_body(body, prompt, req.tenant)).encode()
        t = timing(request)
        resp = await proxy.start(u, "POST", "/v1/completions", {"content-type": "application/json"}, payload,
                                 route, t)
        if isinstance(resp, Failure):
            return response(resp)
        if resp.status != 200:  # the upstream refused the request: its own error, as it is
            text = await read_error(resp)
            u.inflight -= 1
            metrics.request(route, resp.status)
            return Response(text, status_code=resp.status, media_type="application/json")
        metrics.request(route, 200)
        if body.get("stream"):
            return StreamingResponse(translate(u, resp, ext, t), media_type="text/event-stream")
        done = False
        try:
            obj = json.loads(await resp.read())
            done = True
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            return response(proxy.upstream_failure(u, exc, route))
        finally:
            finish(u, resp, done)
        proxy.first_bytes(t)
        metrics.usage(obj.get("usage"))
        return JSONResponse(chat_from_completion(obj, ext))

    async def translate(u: Upstream, resp: aiohttp.ClientResponse, ext: dict, t: dict):
        seen: set[int] = set()
        first = True
        done = False
        try:
            async for raw in resp.content:  # lines
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    yield sse("[DONE]")
                    done = True
                    break
                obj = json.loads(data)
                if first and obj.get("choices"):
                    proxy.first_bytes(t)
                    first = False
                metrics.usage(obj.get("usage"))
                yield sse(chat_chunk(obj, seen, ext))
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            yield sse(error_body(502, f"upstream {u.url} failed mid-stream: {describe(exc)}"))
        finally:
            finish(u, resp, done)

    @api.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return fail(exc.status, str(exc), exc.param, route=request.url.path)

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # 404/405 as OpenAI errors
        return fail(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}; the proxy serves the "
                                     "upstream's /v1/* routes, /tokenize, /detokenize, /health and /metrics",
                    route=request.url.path)

    @api.get("/health")
    async def health():
        if pool.healthy():
            return Response(status_code=200)
        return fail(503, "no healthy upstream", route="/health")

    @api.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.text(pool))

    @api.post("/v1/chat/completions")
    async def chat(request: Request):  # only documents requests get here, parsed by ProxyApp.route
        return await documents(request, request.scope["state"]["json"])

    return ProxyApp(proxy, api)


class ProxyApp:
    """The ASGI front: pass-through routes go to the raw relay (``Proxy.passthrough``: no framework work
    per chunk, which is what the proxy's latency under 64 streams was made of), a chat request carrying
    ``documents`` or ``contextkit`` and everything else to the FastAPI app. Logs one JSON line per request:
    the client's ``x-request-id``, status, and where the time went: ``proxy_ms`` (arrival to forwarding
    upstream: ours), ``upstream_ttft_ms`` (forwarding to the upstream's first body bytes: the server's),
    ``ms_to_headers``, ``ms_total``."""

    OURS = {"/health", "/metrics"}  # everything else under these goes to the upstream as it is
    UPSTREAM = ("/v1/", "/tokenize", "/detokenize", "/version")

    def __init__(self, proxy: Proxy, api: FastAPI):
        self.proxy, self.api = proxy, api
        self.state = api.state  # pool, metrics, settings

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.api(scope, receive, send)  # lifespan
        t = scope.setdefault("state", {})
        t["t0"] = time.perf_counter()
        try:
            if scope["path"].startswith(self.UPSTREAM) and scope["path"] not in self.OURS:
                await self.route(scope, receive, send, t)
            else:
                await self.api(scope, receive, status_recorder(send, t))
        finally:
            self.log(scope, t)

    async def route(self, scope, receive, send, t: dict) -> None:
        body = None
        if scope["method"] in ("POST", "PUT", "PATCH"):
            kind = next((v for k, v in scope["headers"] if k == b"content-type"), b"application/json")
            try:
                body = await read_body(receive, self.proxy.settings.max_body_bytes)
                # JSON is checked here (a malformed body gets our 400, not the upstream's); other bodies
                # (multipart audio uploads, ...) go as they are
                parsed = json_body(body) if kind.startswith(b"application/json") else {}
            except RequestError as exc:
                return await send_failure(send, t, self.proxy.failure(exc.status, str(exc), exc.param, scope["path"]))
            except ClientGone:
                return None
            if scope["path"] == "/v1/chat/completions" and ("documents" in parsed or "contextkit" in parsed):
                t["json"] = parsed
                return await self.api(scope, replay(body, receive), status_recorder(send, t))
        try:
            await self.proxy.passthrough(scope, receive, send, body, t)
        except Exception as exc:  # a bug: the client still gets an OpenAI error, and the log says what
            log.exception("pass-through failed")
            if "status" not in t:
                await send_failure(send, t, self.proxy.failure(500, f"proxy error: {describe(exc)}",
                                                               route=scope["path"]))

    @staticmethod
    def log(scope, t: dict) -> None:
        rid = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        fwd, first, t0 = t.get("forwarded"), t.get("upstream_first"), t["t0"]
        log.info({"method": scope["method"], "path": scope["path"], "status": t.get("status"), "request_id": rid,
                  "proxy_ms": round((fwd - t0) * 1e3, 3) if fwd else None,
                  "upstream_ttft_ms": round((first - fwd) * 1e3, 3) if fwd and first else None,
                  "ms_to_headers": t.get("ms_to_headers"), "ms_total": round((time.perf_counter() - t0) * 1e3, 3)})


class ClientGone(Exception):
    """The client hung up before its request body arrived."""


async def read_body(receive, limit: int) -> bytes:
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise RequestError(413, f"request body is over the limit of {limit} bytes")
        parts.append(part)
        if not message.get("more_body"):
            return b"".join(parts)


def replay(body: bytes, receive):
    """A ``receive`` that hands the already-read body to the next application, then defers to the real one."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def again():
        return pending.pop() if pending else await receive()

    return again


def status_recorder(send, t: dict):
    async def recorded(message):
        if message["type"] == "http.response.start":
            t["status"] = message["status"]
            t["ms_to_headers"] = round((time.perf_counter() - t["t0"]) * 1e3, 3)
        await send(message)

    return recorded


async def send_failure(send, t: dict, f: Failure) -> None:
    body = json.dumps(error_body(f.status, f.message, f.param)).encode()
    t["status"] = f.status
    await send({"type": "http.response.start", "status": f.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def close_on_disconnect(receive, resp: aiohttp.ClientResponse) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    resp.close()  # ends the relay loop; vLLM sees the connection close and aborts the request


def serve(settings: ProxySettings) -> None:
    """Run the proxy with uvicorn until SIGINT/SIGTERM; in-flight streams get ``graceful_shutdown_s``."""
    import uvicorn

    handler = logging.StreamHandler()
    handler.setFormatter(JsonLogFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                timeout_graceful_shutdown=int(settings.graceful_shutdown_s))
