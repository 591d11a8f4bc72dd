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
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request  # module level: route signatures are resolved from module globals
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter

from contextkit.core.errors import (
    ConfigError, ContextKitError, InputError, OverloadedError, http_status,
)  # fmt: skip
from contextkit.core.tenancy import Tenancy
from contextkit.core.tenant import Tenant
from contextkit.integrations.edge.metrics import CONTENT_TYPE, ServerMetrics
from contextkit.integrations.edge.answers import chunk, completion, error_body, error_headers, new_id, sse, usage
from contextkit.integrations.edge.parse import ClientGone, json_body, parse_chat, read_body, validate
from contextkit.integrations.edge.shapes import CompletionBody  # fmt: skip
from contextkit.integrations.edge.openapi import openapi_schema
from contextkit.integrations.edge.ratelimit import RateLimit, RateLimiter
from contextkit.integrations.serve.engine_turns import FairScheduler, Job
from contextkit.kvstore.metrics import StoreCollector

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
    """

    max_queue: int = 32
    max_queue_per_tenant: int = 8
    max_active: int = 8
    deadline_s: float = 300.0
    max_body_bytes: int = 8 << 20
    retry_after_s: float = 2.0
    rate: RateLimit = RateLimit(10.0, 20)  # the engine answers a few requests a second in all
    compile_idle: bool = True

    def __post_init__(self) -> None:
        if min(self.max_queue, self.max_queue_per_tenant, self.max_active, self.max_body_bytes) < 1 or self.deadline_s <= 0:
            raise ConfigError("serve limits must be positive")


def create_serve_app(kit, served_name: str = "contextkit", tenancy: Tenancy | None = None,
                     limits: ServeLimits = ServeLimits(), engine_threads: int | None = None) -> FastAPI:
    """An OpenAI-compatible app over a ``ContextKit`` (its planner, engine and span cache).

    ``tenancy`` maps API keys to tenants (None: an open server, one shared tenant): a request's tenant,
    its span keys and its ordering history come from its key. ``limits`` bound what one client can ask.
    ``engine_threads``: torch threads of the engine thread (set there, first; None: leave them). Load the
    kit with one torch thread and pass the real count here: once another thread has run a parallel
    region, OpenMP makes the engine thread's forwards ~20% slower (measured: a 1.1k-token bf16 prefill
    ~450 ms instead of ~370 ms).
    """
    tenancy = tenancy or Tenancy()
    pending: set[Job] = set()  # queued or running on the engine thread
    idle = (lambda: kit.spans.compile_pending(limit=1) > 0) if limits.compile_idle else None
    start = (lambda: torch.set_num_threads(engine_threads)) if engine_threads else None
    scheduler = FairScheduler(limits.max_active, idle, start)
    limiter = RateLimiter(limits.rate)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        scheduler.close()  # jobs still there end with their clients' answers

    app = FastAPI(title="contextkit serve", lifespan=lifespan)
    app.openapi = lambda: openapi_schema("serve")  # the bodies are parsed by hand: describe them ourselves
    metrics = ServerMetrics("contextkit_serve")
    span_tokens = Counter("contextkit_serve_span_tokens", "prompt tokens of span-reuse requests, by what was done",
                          ("kind",), registry=metrics.registry)
    cancelled = Counter("contextkit_serve_cancelled", "requests stopped early: the client hung up or the deadline passed",
                        ("why",), registry=metrics.registry)
    metrics.registry.register(StoreCollector(kit.spans.store.kv))

    def fail(exc: BaseException, route: str) -> JSONResponse:
        status = http_status(exc)
        metrics.request(route, status)
        return JSONResponse(error_body(exc), status_code=status)

    def usage_of(stream, completion_tokens: int) -> dict:
        cached = stream.report.cached_tokens if stream.report else 0  # KV that existed before this request
        return usage(len(stream.prompt_ids), completion_tokens, cached)

    def extension(stream) -> dict | None:
        rep = stream.report
        if rep is None:
            return None
        span_tokens.labels("prompt").inc(len(stream.prompt_ids))
        for kind in ("reused", "recomputed", "prefilled"):
            span_tokens.labels(kind).inc(getattr(rep, f"{kind}_tokens"))
        return {"reused_tokens": rep.reused_tokens, "cached_tokens": rep.cached_tokens,
                "recomputed_tokens": rep.recomputed_tokens,
                "prefilled_tokens": rep.prefilled_tokens, "compiled_tokens": rep.compiled_tokens,
                "exact_tokens": rep.exact_tokens,
                "span_hits": rep.hits, "span_misses": rep.misses, "policy": rep.policy, "ratio": rep.ratio,
                "order": list(stream.plan.document_ids), "reordered": stream.plan.reordered}

    async def run(make: Callable, body, request: Request, route: str, chat: bool, tenant: Tenant):
        """Queue the request for the engine thread (429 when the queue, or the tenant's share of it, is
        full), then answer, streaming or not. The request ends at its next turn once the client is gone or
        the deadline passed."""
        key = tenant.key_tenant  # a key's sub-tenants share its part of the queue
        mine = sum(j.tenant.key_tenant == key for j in pending)  # at most max_queue jobs to count
        if mine >= limits.max_queue_per_tenant:
            raise OverloadedError(f"{mine} requests of this tenant (its sub-tenants' included) are waiting for "
                                  "the engine; retry shortly", retry_after_s=limits.retry_after_s)
        if len(pending) >= limits.max_queue:
            raise OverloadedError(f"{len(pending)} requests are waiting for the engine; retry shortly",
                                  retry_after_s=limits.retry_after_s)
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        job = Job(loop, make, time.monotonic() + limits.deadline_s, tenant)

        def finished(_) -> None:  # on the engine thread
            loop.call_soon_threadsafe(release, job)

        def release(job: Job) -> None:
            pending.discard(job)
            if job.stopped:
                cancelled.labels(job.stopped).inc()

        job.on_done = finished
        scheduler.submit(job)  # its release runs on this loop, so after the line below
        pending.add(job)
        try:
            kind, value = await job.next_or_disconnect(request)  # planned (or refused), maybe after a wait
        except BaseException:
            job.cancel.set()
            raise
        if kind == "error":
            raise value
        if kind == "done":  # the client hung up while the request waited: it never runs
            metrics.request(route, 499)
            return Response(status_code=499)
        stream = value
        rid, created = new_id(chat), int(time.time())
        ids = {"prompt_token_ids": list(stream.prompt_ids)} if body.return_token_ids else {}
        if not body.stream:
            try:
                while (item := await job.next_or_disconnect(request))[0] == "delta":
                    pass
            finally:
                job.cancel.set()  # client gone or finished: nothing more to decode
            if item[0] == "error":
                raise item[1]
            gen = stream.result
            if gen is None:  # the client hung up: nobody reads this
                metrics.request(route, 499)
                return Response(status_code=499)
            metrics.first_token(gen.prefill_ms / 1e3)
            metrics.request(route, 200)
            out = completion(rid, served_name, chat, [(0, gen.text, gen.finish_reason, ids)],
                             usage_of(stream, len(gen.token_ids)), extension(stream), created)
            return JSONResponse(out)

        metrics.request(route, 200)

        async def events():
            first = True
            try:
                while True:
                    kind, item = await job.next()
                    if kind == "done":
                        break
                    if kind == "error":
                        yield sse(error_body(item))
                        break
                    if first:
                        metrics.first_token(time.perf_counter() - t0)
                    out = chunk(rid, served_name, chat, [(0, item, first, None)], created)
                    if first:
                        out["choices"][0].update(ids)  # vLLM sends the prompt's ids with the first delta
                    first = False
                    yield sse(out)
                gen = stream.result
                if gen is not None:
                    yield sse(chunk(rid, served_name, chat, [(0, "", first, gen.finish_reason)], created))
                    yield sse(chunk(rid, served_name, chat, [], created, usage_of(stream, len(gen.token_ids)),
                                    extension(stream)))
                yield sse("[DONE]")
            finally:  # the client hung up (the generator is closed) or the stream ended
                job.cancel.set()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.exception_handler(ContextKitError)
    async def _error(request: Request, exc: ContextKitError):
        response = fail(exc, request.url.path)
        response.headers.update(error_headers(exc))
        return response

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    async def body_of(request: Request) -> dict:
        """The JSON body, read up to ``limits.max_body_bytes`` (413 past it)."""
        return json_body(await read_body(request.receive, limits.max_body_bytes, request.headers.get("content-length")))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):  # nobody reads this answer
        metrics.request(request.url.path, 499)
        return Response(status_code=499)

    def sampling(body):
        if body.n not in (None, 1):
            raise InputError(f"n={body.n}: serve answers one choice per request; send {body.n} requests", "n")
        return body.sampling()

    def caller(request: Request) -> Tenant:
        """The key's tenant, within its request rate (401 and 429 come before the body is read)."""
        tenant = tenancy.authenticate(request.headers.get("authorization"))
        limiter.check(tenant)
        return tenant

    @app.get("/v1/models")
    async def models(request: Request):
        caller(request)
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "contextkit",
                                            "max_model_len": kit.engine.spec.max_positions}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        caller(request)
        body = await body_of(request)
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise InputError("prompt must be a string", "prompt")
        # up to max_body_bytes of text: tokenized on a worker thread (the loop's default executor, a few
        # threads), so the streams this loop feeds keep flowing meanwhile
        ids = await asyncio.to_thread(kit.tokenizer.encode, prompt,
                                      add_special_tokens=bool(body.get("add_special_tokens", False)))
        return {"tokens": ids, "count": len(ids), "max_model_len": kit.engine.spec.max_positions}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        tenant = caller(request)
        body, req = parse_chat(await body_of(request), lambda name: tenancy.resolve(tenant, name),
                               allow_reuse=True, default_max_tokens=256)
        params = sampling(body)
        return await run(lambda: kit.run(kit.plan(req), params, compile_after=False), body, request,
                         "/v1/chat/completions", chat=True, tenant=req.tenant)

    @app.post("/v1/completions")
    async def completions(request: Request):
        tenant = caller(request)
        body: CompletionBody = validate(CompletionBody, await body_of(request))
        params = sampling(body)

        def make():
            plan = kit.planner.plan_prompt(body.prompt, tenant, max_new_tokens=params.max_new_tokens)
            return kit.run(plan, params, compile_after=False)

        return await run(make, body, request, "/v1/completions", chat=False, tenant=tenant)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    app.state.kit, app.state.tenancy, app.state.pending, app.state.scheduler = kit, tenancy, pending, scheduler
    app.state.limiter = limiter
    return app
