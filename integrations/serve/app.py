"""``contextkit serve``: the OpenAI API on the built-in engine, with the full KV path.

Requests are parsed by the shapes the proxy uses (``openai_api``) and planned by the facade's planner,
so a request renders to the same tokens here as through the proxy or ``ContextKit``. A chat with
``documents`` runs them as spans: each document's KV is compiled once, kept in the configured kvstore
(memory, LMCache disk, LMCache remote), re-positioned into later requests and partly recomputed per the
request's policy (``contextkit.reuse``: ``{"policy", "ratio", ...}``, the fields of ``ReuseOptions``;
default: query attention at r = 0.1 plus each span's first two tokens). The response's ``contextkit``
field reports reused, recomputed and prefilled tokens; ``usage`` counts the reused ones as
``prompt_tokens_details.cached_tokens``. A chat without documents and ``/v1/completions`` run a full
prefill. One engine, one request at a time (a CPU engine gains nothing from interleaving); requests
queue, planning and all, on the engine thread, and streams are fed from it as tokens come.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request  # module level: route signatures are resolved from module globals
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter

from contextkit.core.errors import (
    ConfigError,
    ContextKitError,
    InputError,
    OverloadedError,
    http_status,
)  # fmt: skip
from contextkit.core.generation import SamplingParams
from contextkit.core.tenancy import Tenancy
from contextkit.core.tenant import Tenant
from contextkit.core.types import HANDLE
from contextkit.integrations.edge.answers import error_body, error_headers, new_id
from contextkit.integrations.edge.metrics import CONTENT_TYPE, ServerMetrics, check_metrics_access
from contextkit.integrations.edge.openapi import openapi_schema
from contextkit.integrations.edge.parse import ClientGone, json_body, named_handles, parse_chat, read_body, validate
from contextkit.integrations.edge.ratelimit import RateLimit, RateLimiter
from contextkit.integrations.edge.shapes import CompletionBody
from contextkit.integrations.serve.answer import StartedAnswer
from contextkit.integrations.serve.engine_turns import EngineThreadScheduler, Job
from contextkit.integrations.serve.kept import KeptAnswers, Turn
from contextkit.kit import ContextKit, KitStream
from contextkit.kvstore.metrics import StoreCollector
from contextkit.synthesis.handles import KeepLimits


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """What one client can ask of ``serve``.

    Attributes:
        max_queue: requests waiting for or on the engine; one more gets 429 with ``Retry-After``.
        max_queue_per_tenant: the same, for one key tenant, its sub-tenants' requests included (so one
            key cannot fill the queue, however many sub-tenants it names).
        max_active: requests decoding in turns at once (each holds its KV); the others wait their turn.
        deadline_s: a request's longest time from arrival to its last token (then 504, or an error event).
        max_body_bytes: a larger request body gets 413.
        retry_after_s: what a 429 from a full queue tells the client to wait.
        rate: requests per second per tenant, checked before the body is read (429 past it).
        compile_idle: compile documents that requests computed in context (no KV yet) into position-free
            spans while the engine is idle, one span per idle turn, so later requests reuse them at any
            position; off: they are reused exactly after the same prefix, and elsewhere from the KV
            their first request computed (``SpanCache.borrowed``).
        keep: what workers' kept answers may hold (``contextkit.keep``; ``synthesis.handles.KeepLimits``).
    """

    max_queue: int = 32
    max_queue_per_tenant: int = 8
    max_active: int = 8
    deadline_s: float = 300.0
    max_body_bytes: int = 8 << 20
    retry_after_s: float = 2.0
    rate: RateLimit = RateLimit(10.0, 20)  # the engine answers a few requests a second in all
    compile_idle: bool = True
    keep: KeepLimits = KeepLimits()

    def __post_init__(self) -> None:
        if min(self.max_queue, self.max_queue_per_tenant, self.max_active,
               self.max_body_bytes) < 1 or self.deadline_s <= 0:
            raise ConfigError("serve limits must be positive")


def create_serve_app(kit: ContextKit, served_name: str = "contextkit", tenancy: Tenancy | None = None,
                     limits: ServeLimits = ServeLimits(), engine_threads: int | None = None, *,
                     metrics_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app over a ``ContextKit`` (its planner, engine and span cache).

    ``tenancy`` maps API keys to tenants (None: an open server, one shared tenant): a request's tenant,
    its span keys and its ordering history come from its key. ``limits`` bound what one client can ask.
    ``engine_threads``: torch threads of the engine thread (set there, first; None: leave them). Load the
    kit with one torch thread and pass the real count here: once another thread has run a parallel
    region, OpenMP makes the engine thread's forwards ~20% slower (measured: a 1.1k-token bf16 prefill
    ~450 ms instead of ~370 ms). ``metrics_key``: what ``/metrics`` takes as ``Bearer`` (required there
    when ``tenancy`` has keys; ``edge.metrics.check_metrics_access``).
    """
    if metrics_key is not None and len(metrics_key) < 16:
        raise ConfigError("the metrics key must be at least 16 characters")
    app = ServeApp(kit, served_name, tenancy or Tenancy(), limits, engine_threads)
    app.metrics_key = metrics_key
    return app.build()


class _EngineWork:
    """serve's ``EngineThreadWork``: the engine thread's torch threads, and while it is quiet the kit's
    span compiles, one unit at a time (``ServeLimits.compile_idle``)."""

    def __init__(self, kit: ContextKit, *, torch_threads: int | None, compile_idle: bool):
        self._kit, self._torch_threads, self._compile_idle = kit, torch_threads, compile_idle

    def start_engine_thread(self) -> None:
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)

    def background_unit(self) -> bool:
        return self._compile_idle and self._kit.compile_pending_spans(limit=1) > 0


class ServeApp:
    """One serve app's state: the kit, the scheduler of its engine thread, the queue of requests on it,
    the limits and the metrics; a method per route and per step of a request (``build`` makes the app)."""

    def __init__(self, kit: ContextKit, served_name: str, tenancy: Tenancy, limits: ServeLimits,
                 engine_threads: int | None):
        self.kit, self.served_name, self.tenancy, self.limits = kit, served_name, tenancy, limits
        self.metrics_key: str | None = None  # /metrics' key (create_serve_app)
        self.pending: set[Job] = set()  # queued or running on the engine thread (changed on the event loop)
        self._released = threading.Condition()  # notified as jobs leave ``pending`` (wait_settled)
        work = _EngineWork(kit, torch_threads=engine_threads, compile_idle=limits.compile_idle)
        self.scheduler = EngineThreadScheduler(work, limits.max_active)
        self.limiter = RateLimiter(limits.rate)
        self.metrics = ServerMetrics("contextkit_serve")
        self.span_tokens = Counter("contextkit_serve_span_tokens",
                                   "prompt tokens of span-reuse requests, by what was done",
                                   ("kind",), registry=self.metrics.registry)
        self.cancelled = Counter("contextkit_serve_cancelled",
                                 "requests stopped early: the client hung up or the deadline passed",
                                 ("why",), registry=self.metrics.registry)
        self.metrics.registry.register(StoreCollector(kit.kv_store))
        self.kept = KeptAnswers(limits.keep, self.metrics.registry)

    def build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            yield
            self.scheduler.close()  # jobs still there end with their clients' answers

        app = FastAPI(title="contextkit serve", lifespan=lifespan)
        app.openapi = lambda: openapi_schema("serve")  # the bodies are parsed by hand: describe them ourselves
        app.add_exception_handler(ContextKitError, self._error)
        app.add_exception_handler(ClientGone, self._gone)
        app.get("/health")(self.health)
        app.get("/v1/models")(self.models)
        app.post("/tokenize")(self.tokenize)
        app.post("/v1/chat/completions")(self.chat)
        app.post("/v1/completions")(self.completions)
        app.delete("/v1/contextkit/kept/{handle}")(self.forget)
        app.get("/metrics")(self.prometheus)
        app.state.serve = self
        app.state.kit, app.state.tenancy, app.state.pending = self.kit, self.tenancy, self.pending
        app.state.scheduler, app.state.limiter = self.scheduler, self.limiter
        return app

    def wait_settled(self, timeout_s: float) -> bool:
        """Block until every request submitted so far has ended and been released on the event loop (the
        engine thread and the queue hold none of them, nor their KV) and the engine thread has no
        background work left; False if ``timeout_s`` passed first. For drains and tests."""
        deadline = time.monotonic() + timeout_s
        if not self.scheduler.wait_until_idle(timeout_s):
            return False
        with self._released:
            return self._released.wait_for(lambda: not self.pending, max(0.0, deadline - time.monotonic()))

    # --- the routes ---

    async def health(self):
        return Response(status_code=200)

    async def models(self, request: Request):
        self._caller(request)
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "owned_by": "contextkit",
                                            "max_model_len": self.kit.max_positions}]}

    async def tokenize(self, request: Request):
        self._caller(request)
        body = await self._body_of(request)
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise InputError("prompt must be a string", "prompt")
        # up to max_body_bytes of text: tokenized on a worker thread (the loop's default executor, a few
        # threads), so the streams this loop feeds keep flowing meanwhile
        ids = await asyncio.to_thread(self.kit.tokenize, prompt,
                                      add_special_tokens=bool(body.get("add_special_tokens", False)))
        return {"tokens": ids, "count": len(ids), "max_model_len": self.kit.max_positions}

    async def chat(self, request: Request):
        tenant = self._caller(request)
        body, req = parse_chat(await self._body_of(request), functools.partial(self.tenancy.resolve, tenant),
                               allow_reuse=True, default_max_tokens=256)
        params = self._sampling(body)
        turn = Turn(new_id(True), bool(body.contextkit and body.contextkit.keep), named_handles(body))
        self.kept.check(turn)
        start = functools.partial(self.kept.start, self.kit, req, params, turn)
        return await self._run(start, body, request, "/v1/chat/completions", chat=True, tenant=req.tenant,
                               turn=turn)

    async def completions(self, request: Request):
        tenant = self._caller(request)
        body: CompletionBody = validate(CompletionBody, await self._body_of(request))
        params = self._sampling(body)
        start = functools.partial(self._start_completion, body.prompt, tenant, params)
        return await self._run(start, body, request, "/v1/completions", chat=False, tenant=tenant,
                               turn=Turn(new_id(False)))

    async def forget(self, handle: str, request: Request):
        """Drop a kept answer of the caller's tenant (``contextkit.tenant`` as a query parameter for a
        sub-tenant); ``{"deleted": false}`` for one it does not have (another tenant's included)."""
        tenant = self.tenancy.resolve(self._caller(request), request.query_params.get("tenant"))
        if not HANDLE.fullmatch(handle):
            raise InputError("a handle is 1-128 letters, digits or '_.:-'", "handle")
        return {"handle": handle, "deleted": self.kept.drop(tenant, handle)}

    async def prometheus(self, request: Request):
        check_metrics_access(key=self.metrics_key, keyed=not self.tenancy.open,
                             authorization=request.headers.get("authorization", "").encode("latin-1") or None,
                             client=request.client.host if request.client else "")
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    async def _error(self, request: Request, exc: ContextKitError):
        status = http_status(exc)
        self.metrics.request(request.url.path, status)
        response = JSONResponse(error_body(exc), status_code=status)
        response.headers.update(error_headers(exc))
        return response

    async def _gone(self, request: Request, exc: ClientGone):  # nobody reads this answer
        self.metrics.request(request.url.path, 499)
        return Response(status_code=499)

    # --- reading a request ---

    def _caller(self, request: Request) -> Tenant:
        """The key's tenant, within its request rate (401 and 429 come before the body is read)."""
        tenant = self.tenancy.authenticate(request.headers.get("authorization"))
        self.limiter.check(tenant)
        return tenant

    async def _body_of(self, request: Request) -> dict:
        """The JSON body, read up to ``limits.max_body_bytes`` (413 past it)."""
        raw = await read_body(request.receive, self.limits.max_body_bytes, request.headers.get("content-length"))
        return json_body(raw)

    @staticmethod
    def _sampling(body):
        if body.n not in (None, 1):
            raise InputError(f"n={body.n}: serve answers one choice per request; send {body.n} requests", "n")
        return body.sampling()

    # --- on the engine thread: a job's first turn plans and starts it ---

    def _start_completion(self, prompt: str | list[int], tenant: Tenant, params: SamplingParams) -> KitStream:
        plan = self.kit.plan_prompt(prompt, tenant, max_new_tokens=params.max_new_tokens)
        return self.kit.run(plan, params, compile_after=False)

    # --- a request's life: admitted, queued for the engine thread, answered, released ---

    def _admit(self, tenant: Tenant) -> None:
        """429 when the queue, or the tenant's share of it, is full."""
        key = tenant.key_tenant  # a key's sub-tenants share its part of the queue
        mine = sum(j.tenant.key_tenant == key for j in self.pending)  # at most max_queue jobs to count
        if mine >= self.limits.max_queue_per_tenant:
            raise OverloadedError(f"{mine} requests of this tenant (its sub-tenants' included) are waiting for "
                                  "the engine; retry shortly", retry_after_s=self.limits.retry_after_s)
        if len(self.pending) >= self.limits.max_queue:
            raise OverloadedError(f"{len(self.pending)} requests are waiting for the engine; retry shortly",
                                  retry_after_s=self.limits.retry_after_s)

    def _submit(self, start: Callable[[], KitStream], tenant: Tenant) -> Job:
        job = Job(asyncio.get_running_loop(), start, time.monotonic() + self.limits.deadline_s, tenant)
        job.on_done = self._done_on_engine_thread
        self.scheduler.submit(job)  # its release runs on this loop, so after the lines below
        with self._released:
            self.pending.add(job)
        return job

    def _done_on_engine_thread(self, job: Job) -> None:
        job.loop.call_soon_threadsafe(self._release, job)

    def _release(self, job: Job) -> None:  # on the event loop
        with self._released:
            self.pending.discard(job)
            self._released.notify_all()
        if job.stopped:
            self.cancelled.labels(job.stopped).inc()

    async def _run(self, start: Callable[[], KitStream], body, request: Request, route: str, chat: bool,
                   tenant: Tenant, turn: Turn):
        """Queue the request for the engine thread, then answer, streaming or not. The request ends at its
        next turn once the client is gone or the deadline passed."""
        self._admit(tenant)
        t0 = time.perf_counter()
        job = self._submit(start, tenant)
        try:
            kind, value = await job.next_or_disconnect(request)  # planned (or refused), maybe after a wait
        except BaseException:
            job.cancel.set()
            raise
        if kind == "error":
            raise value
        if kind == "done":  # the client hung up while the request waited: it never runs
            self.metrics.request(route, 499)
            return Response(status_code=499)
        answer = StartedAnswer(self, value, chat, body.return_token_ids, turn)
        if not body.stream:
            return await answer.whole(job, request, route)
        self.metrics.request(route, 200)
        return StreamingResponse(answer.events(job, t0), media_type="text/event-stream")
