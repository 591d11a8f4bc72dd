"""The proxy's upstream I/O: one aiohttp session, opening requests, and the raw pass-through relay.

Every request to an upstream runs inside ``UpstreamPool.lease(u)`` in one coroutine, so the in-flight
count goes back whatever ends it (a client gone, an upstream failure, a bug). Failures are raised as the
errors of ``contextkit.core.errors`` (502 ``UpstreamError``, 503 ``NoUpstreamError``, 504
``UpstreamTimeoutError``); ``ProxyApp`` answers them as OpenAI error objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time

import aiohttp
import yarl

from contextkit.core.errors import NoUpstreamError, UpstreamError, UpstreamTimeoutError
from contextkit.integrations.edge.answers import error_body, sse
from contextkit.integrations.proxy.exchange import Exchange
from contextkit.integrations.proxy.reuse_paths import reuse_path
from contextkit.integrations.proxy.routes import Route, scrub_answer
from contextkit.integrations.proxy.routing import Routed, Router
from contextkit.integrations.proxy.settings import ProxySettings
from contextkit.integrations.proxy.span_compiler import SpanCompiler
from contextkit.integrations.proxy.upstreams import Upstream, UpstreamPool
from contextkit.ordering.event_order import SearchLimits

HOP = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"accept-encoding"}
# the client's key is for us (the upstream gets its own); its Content-Type is the proxy's to set; the
# request id vLLM keys the request by is the proxy's (``upstream_request_id``)
NOT_FORWARDED = HOP | {b"authorization", b"content-type", b"x-request-id"}
UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)  # what talking to an upstream can raise
MAX_CLIENT_ID = 128  # characters of a client's x-request-id kept for its log line and echo
log = logging.getLogger("contextkit.proxy")


def describe(exc: BaseException) -> str:
    """An exception for the log (it may name an upstream's address: never put it in an answer)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def upstream_request_id() -> str:
    """A request id of the proxy's own, the one vLLM sees (header and body): unguessable, so no client can
    name another's request to vLLM."""
    return "ctxk-" + secrets.token_hex(12)


def client_request_id(headers) -> str | None:
    """The client's ``x-request-id`` (printable ASCII, cut to ``MAX_CLIENT_ID``), for its log line and echo."""
    raw = next((v for k, v in headers if k == b"x-request-id"), None)
    if raw is None:
        return None
    text = raw.decode("latin-1")[:MAX_CLIENT_ID]
    return text if text.isascii() and text.isprintable() else None


def proxy_ms(t: Exchange) -> tuple[bytes, bytes]:
    """The proxy's own time on a request, arrival to forwarding upstream (the ``x-contextkit-proxy-ms``
    header of every answer the upstream gave)."""
    return b"x-contextkit-proxy-ms", b"%.3f" % t.proxy_ms()


def echo_id(t: Exchange) -> list[tuple[bytes, bytes]]:
    """The client's request id back to it, if it sent one."""
    rid = t.client_request_id
    return [(b"x-request-id", rid.encode())] if rid else []


async def send_json(send, t: Exchange, status: int, obj: dict, headers: list | None = None) -> None:
    body = json.dumps(obj).encode()
    t.status = status
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *echo_id(t),
        *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


async def close_on_disconnect(receive, resp: aiohttp.ClientResponse) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    resp.close()  # ends the relay loop; vLLM sees the connection close and aborts the request


async def read_error(resp: aiohttp.ClientResponse) -> str:
    """The start of an upstream's error body (the response is closed afterwards)."""
    try:
        return (await resp.content.read(500)).decode(errors="replace")
    except UPSTREAM_ERRORS as exc:
        return type(exc).__name__  # its text may name the upstream's address
    finally:
        resp.close()


class Upstreams:
    """The pool, the session and the calls every route makes to an upstream."""

    def __init__(self, settings: ProxySettings, metrics):
        self.settings = settings
        self.reuse = reuse_path(settings.kv_connector)  # what documents requests' opt-in to reuse does
        self.pool = UpstreamPool(settings.upstreams, settings.block_size)
        self.router = Router(self.pool.upstreams, settings)
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None
        self._model_len: dict[str, int | None] = {}
        self.compiler = SpanCompiler(self._post_json, settings.span_compiles, registry=metrics.registry)
        self.search_limits = SearchLimits(max_scores=settings.event_order_scores,
                                          deadline_s=settings.event_order_deadline_ms / 1e3)
        self._separator: list[int] | None = None

    def blend_separator(self, tokenizer) -> list[int]:
        """The token ids LMCache's CacheBlend splits prompts at (``kv_connector="cacheblend"``), found once."""
        if self._separator is None:
            from contextkit.integrations.vllm_connector.cacheblend import CacheBlendConfig, separator_ids

            self._separator = separator_ids(tokenizer, CacheBlendConfig(separator=self.settings.cacheblend_separator))
        return self._separator

    async def open(self) -> None:
        # aiohttp, not httpx: httpx's connection pool rescans every pooled connection (a poll() each) on
        # every request and response event, which at 64 concurrent streams cost the proxy ~3 ms of CPU
        # per request (profiled); aiohttp hands out an idle connection in O(1) and parses in C
        connector = aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(connect=self.settings.connect_timeout_s, sock_read=self.settings.timeout_s)
        key = self.settings.upstream_api_key
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",),
                                             headers={"Authorization": f"Bearer {key}"} if key else None)
        await self.pool.check(self.session)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _post_json(self, url: str, body: bytes) -> int:
        """POST a completion to an upstream for the proxy itself (span compiles); the status."""
        async with self.session.post(url + "/v1/completions", data=body,
                                     headers={"content-type": "application/json"}) as r:
            await r.read()
            return r.status

    def failure(self, u: Upstream, exc: BaseException) -> UpstreamError:
        """The error to answer a failed call to ``u`` with (a connection failure also counts against it)."""
        if isinstance(exc, TimeoutError):
            return UpstreamTimeoutError(f"upstream {u.name} did not answer within {self.settings.timeout_s:.0f} s; "
                                        "raise --timeout-s or check the server's load")
        self.pool.mark_failed(u)
        # aiohttp's text names the host and port ("Cannot connect to host H:P"): the log has it, the answer
        # names the upstream (upstreams.py: the URL is the operator's)
        log.warning({"event": "upstream failed", "upstream": u.name, "url": u.url, "error": describe(exc)})
        return UpstreamError(f"upstream {u.name} failed ({type(exc).__name__}); it is out of rotation until its "
                             "/health answers")

    def least_loaded(self) -> Upstream:
        u = self.pool.least_loaded()
        if u is None:
            raise NoUpstreamError("no healthy upstream; check the vLLM servers' /health")
        return u

    async def start(self, u: Upstream, method: str, url: str, headers: dict, body: bytes | None,
                    t: Exchange) -> aiohttp.ClientResponse:
        """Open a request to ``u`` (inside its lease). A connection failure or a 5xx answer is raised
        as our 502/504."""
        t.forwarded = time.perf_counter()
        target = yarl.URL(u.url + url, encoded=True)  # as the client sent it: no re-quoting of path or query
        try:
            try:
                resp = await self.session.request(method, target, data=body, headers=headers)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):  # nothing listens: no retry
                    raise
                # a pooled keep-alive connection the server had just closed: the request never reached
                # it, so one retry on a fresh connection is safe (what every production proxy does)
                resp = await self.session.request(method, target, data=body, headers=headers)
        except UPSTREAM_ERRORS as exc:
            raise self.failure(u, exc) from None
        u.consecutive_failures = 0
        if resp.status >= 500:
            raise UpstreamError(f"upstream {u.name} answered {resp.status}: {await read_error(resp)}")
        return resp

    def first_bytes(self, t: Exchange) -> None:
        t.upstream_first = now = time.perf_counter()
        self.metrics.first_token(now - t.t0)

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

    async def passthrough(self, scope, receive, send, route: Route, body: bytes | None, t: Exchange,
                          routed: Routed | None = None) -> None:
        """Forward a request on ``route`` to the upstream ``routed`` chose (None: the least loaded), and its
        answer as it comes: the route's own path (no query string), the body as the proxy serialized it,
        the client's headers but for hop-by-hop ones, its key and its Content-Type."""
        u = routed.choice.upstream if routed is not None else self.least_loaded()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k not in NOT_FORWARDED}
        headers["x-request-id"] = t.request_id  # the proxy's, never the client's
        if body is not None:
            headers["content-type"] = "application/json"
        sent = self.router.sent(u, routed.keys) if routed is not None else None
        with self.pool.lease(u):
            resp = await self.start(u, route.method, route.path, headers, body, t)
            self.router.accepted(sent, resp.status)  # vLLM took it (2xx): its KV events are due
            out = [(k, v) for k, v in resp.raw_headers if k.lower() not in HOP and k.lower() != b"x-request-id"]
            out += echo_id(t)
            out.append(proxy_ms(t))
            # "unplaced": one upstream, or a route that is not generation (to the least loaded, unscored)
            rule = routed.choice.rule if routed is not None else "unplaced"
            out += [(b"x-contextkit-upstream", u.name.encode()), (b"x-contextkit-route", rule.encode())]
            if "text/event-stream" in resp.headers.get("content-type", ""):
                return await self.relay(u, resp, receive, send, out, t)
            try:
                content = await resp.read()
            except UPSTREAM_ERRORS as exc:
                resp.close()
                raise self.failure(u, exc) from None
            resp.release()
        self.first_bytes(t)
        content = scrub_answer(content)  # the connector's echo of what it loaded stays here
        out.append((b"content-length", str(len(content)).encode()))
        t.status = resp.status
        await send({"type": "http.response.start", "status": resp.status, "headers": out})
        await send({"type": "http.response.body", "body": content})

    async def relay(self, u: Upstream, resp: aiohttp.ClientResponse, receive, send, headers: list, t: Exchange):
        """Stream the upstream's bytes to the client as they arrive."""
        t.status = resp.status
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        async with streamed(u, resp, receive, send) as stream:
            async for chunk in resp.content.iter_any():
                if t.upstream_first is None:
                    self.first_bytes(t)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            stream.done = True


class _Streamed:
    done = False  # the upstream's response was read to its end


@contextlib.asynccontextmanager
async def streamed(u: Upstream, resp: aiohttp.ClientResponse, receive, send):
    """The lifetime of one relayed stream (pass-through or translated). A client that hangs up closes the
    upstream response (vLLM aborts the request); an upstream failing mid-stream gets an error event; a
    response read to its end gives its connection back to the pool, any other is closed. The body ends
    either way."""
    state = _Streamed()
    watcher = asyncio.ensure_future(close_on_disconnect(receive, resp))
    try:
        yield state
    except (*UPSTREAM_ERRORS, ValueError) as exc:  # ValueError: an upstream event that is not JSON
        if not watcher.done():  # the upstream failed, not the client
            log.warning({"event": "upstream failed mid-stream", "upstream": u.name, "error": describe(exc)})
            event = sse(error_body(UpstreamError(f"upstream {u.name} failed mid-stream ({type(exc).__name__})")))
            await send({"type": "http.response.body", "body": event, "more_body": True})
    finally:
        watcher.cancel()
        resp.release() if state.done else resp.close()
    await send({"type": "http.response.body", "body": b""})
