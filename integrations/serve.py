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
import concurrent.futures
import time
from collections.abc import Callable

from fastapi import FastAPI, Request  # module level: route signatures are resolved from module globals
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter

from contextkit.core.errors import ContextKitError, InputError, http_status
from contextkit.integrations.metrics import CONTENT_TYPE, ServerMetrics
from contextkit.integrations.openai_api import (
    CompletionBody, chunk, completion, error_body, json_body, new_id, parse_chat, sse, usage, validate,
)  # fmt: skip
from contextkit.kvstore.metrics import StoreCollector

_DONE = object()


def create_serve_app(kit, served_name: str = "contextkit") -> FastAPI:
    """An OpenAI-compatible app over a ``ContextKit`` (its planner, engine and span cache)."""
    app = FastAPI(title="contextkit serve")
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    metrics = ServerMetrics("contextkit_serve")
    span_tokens = Counter("contextkit_serve_span_tokens", "prompt tokens of span-reuse requests, by what was done",
                          ("kind",), registry=metrics.registry)
    metrics.registry.register(StoreCollector(kit.spans.store.kv))

    def fail(exc: BaseException, route: str) -> JSONResponse:
        status = http_status(exc)
        metrics.request(route, status)
        return JSONResponse(error_body(exc), status_code=status)

    def usage_of(stream, completion_tokens: int) -> dict:
        cached = stream.report.reused_tokens if stream.report else 0
        return usage(len(stream.prompt_ids), completion_tokens, cached)

    def extension(stream) -> dict | None:
        rep = stream.report
        if rep is None:
            return None
        span_tokens.labels("prompt").inc(len(stream.prompt_ids))
        for kind in ("reused", "recomputed", "prefilled"):
            span_tokens.labels(kind).inc(getattr(rep, f"{kind}_tokens"))
        return {"reused_tokens": rep.reused_tokens, "recomputed_tokens": rep.recomputed_tokens,
                "prefilled_tokens": rep.prefilled_tokens, "compiled_tokens": rep.compiled_tokens,
                "span_hits": rep.hits, "span_misses": rep.misses, "policy": rep.policy, "ratio": rep.ratio,
                "order": list(stream.plan.document_ids), "reordered": stream.plan.reordered}

    async def run(make: Callable, body, route: str, chat: bool):
        """Plan and start on the engine thread, then answer, streaming or not."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            stream = await loop.run_in_executor(worker, make)
        except ContextKitError as exc:
            return fail(exc, route)
        rid, created = new_id(chat), int(time.time())
        ids = {"prompt_token_ids": list(stream.prompt_ids)} if body.return_token_ids else {}
        if not body.stream:
            gen = await loop.run_in_executor(worker, stream.finish)
            metrics.first_token(gen.prefill_ms / 1e3)
            metrics.request(route, 200)
            out = completion(rid, served_name, chat, [(0, gen.text, gen.finish_reason, ids)],
                             usage_of(stream, len(gen.token_ids)), extension(stream), created)
            return JSONResponse(out)

        queue: asyncio.Queue = asyncio.Queue()

        def produce() -> None:
            try:
                for delta in stream:
                    loop.call_soon_threadsafe(queue.put_nowait, delta)
            except ContextKitError as exc:
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            loop.call_soon_threadsafe(queue.put_nowait, _DONE)

        fut = loop.run_in_executor(worker, produce)
        metrics.request(route, 200)

        async def events():
            first = True
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, Exception):
                    yield sse(error_body(item))
                    break
                if first:
                    metrics.first_token(time.perf_counter() - t0)
                out = chunk(rid, served_name, chat, [(0, item, first, None)], created)
                if first:
                    out["choices"][0].update(ids)  # vLLM sends the prompt's ids with the first delta
                first = False
                yield sse(out)
            await fut
            gen = stream.result
            if gen is not None:
                yield sse(chunk(rid, served_name, chat, [(0, "", first, gen.finish_reason)], created))
                yield sse(chunk(rid, served_name, chat, [], created, usage_of(stream, len(gen.token_ids)),
                                extension(stream)))
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.exception_handler(ContextKitError)
    async def _error(request: Request, exc: ContextKitError):
        return fail(exc, request.url.path)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "contextkit",
                                            "max_model_len": kit.engine.spec.max_positions}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = json_body(await request.body())
        prompt = body.get("prompt", "")
        if not isinstance(prompt, str):
            raise InputError("prompt must be a string", "prompt")
        ids = kit.tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", False)))
        return {"tokens": ids, "count": len(ids), "max_model_len": kit.engine.spec.max_positions}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body, req = parse_chat(json_body(await request.body()), allow_reuse=True, default_max_tokens=256)
        params = body.sampling()
        return await run(lambda: kit.run(kit.plan(req), params), body, "/v1/chat/completions", chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionBody = validate(CompletionBody, json_body(await request.body()))
        params = body.sampling()

        def make():
            return kit.run(kit.planner.plan_prompt(body.prompt, max_new_tokens=params.max_new_tokens), params)

        return await run(make, body, "/v1/completions", chat=False)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    app.state.kit = kit
    return app
