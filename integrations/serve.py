"""``contextkit serve``: the OpenAI API on the built-in engine, with the full KV path.

``/v1/chat/completions`` with ``documents`` runs them as spans: each document's KV is compiled once,
kept in the configured kvstore (memory, LMCache disk, LMCache remote), re-positioned into later requests
and partly recomputed per the request's policy (``contextkit.reuse``: ``{"policy", "ratio", ...}``, the
fields of ``ReuseOptions``; default: query attention at r = 0.1 plus each span's first two tokens). The
response's ``contextkit`` field reports reused, recomputed and prefilled tokens; ``usage`` counts the
reused ones as ``prompt_tokens_details.cached_tokens``. Chat without documents and ``/v1/completions``
run a full prefill. One engine, one request at a time (a CPU engine gains nothing from interleaving);
requests queue, and streams are fed from the engine thread as tokens come.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from contextkit.engine.generate import SamplingParams, Stream
from contextkit.errors import ConfigError, ContextKitError, InputError, PromptTooLongError
from contextkit.integrations.prom import Counter, Histogram
from contextkit.integrations.proxy import error_body
from contextkit.integrations.proxy_docs import OPTIONS, RequestError, json_body, parse, sse
from contextkit.plan import ReuseOptions

_DONE = object()


def _params(body: dict) -> SamplingParams:
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    try:
        return SamplingParams(
            max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 256),
            temperature=float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0),
            top_p=float(body.get("top_p") or 1.0), top_k=int(body.get("top_k") or 0),
            seed=body.get("seed"), stop=stop,
        )  # fmt: skip
    except (ConfigError, TypeError, ValueError) as exc:
        raise RequestError(422, f"sampling parameters: {exc}") from exc


def _reuse(opts: dict | None) -> ReuseOptions:
    if not opts:
        return ReuseOptions()
    if not isinstance(opts, dict):
        raise RequestError(422, "contextkit.reuse must be an object with ReuseOptions fields (policy, ratio, ...)")
    names = {f.name for f in dataclasses.fields(ReuseOptions)}
    unknown = set(opts) - names
    if unknown:
        raise RequestError(422, f"contextkit.reuse has unknown fields {sorted(unknown)}; known: {sorted(names)}")
    try:
        return ReuseOptions(**opts)
    except (ConfigError, TypeError) as exc:
        raise RequestError(422, f"contextkit.reuse: {exc}") from exc


def create_serve_app(kit, served_name: str = "contextkit") -> FastAPI:
    """An OpenAI-compatible app over a ``ContextKit`` (its engine, tokenizer and span cache)."""
    app = FastAPI(title="contextkit serve")
    worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    counts = Counter("contextkit_serve_requests_total", ("route", "status"))
    ttft = Histogram("contextkit_serve_ttft_seconds")
    tokens = {"prompt": 0, "reused": 0, "recomputed": 0, "prefilled": 0}

    def count(route: str, status: int) -> None:
        counts.inc(route, status)

    def first(seconds: float) -> None:
        ttft.observe(seconds)

    def fail(status: int, message: str, route: str, param: str | None = None) -> JSONResponse:
        count(route, status)
        return JSONResponse(error_body(status, message, param), status_code=status)

    async def body_json(request: Request) -> dict:
        return json_body(await request.body())

    def usage(stream: Stream, completion: int) -> dict:
        rep = stream.report
        cached = rep.reused_tokens if rep else 0
        return {"prompt_tokens": len(stream.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(stream.prompt_ids) + completion, "prompt_tokens_details": {"cached_tokens": cached}}

    def extension(stream: Stream) -> dict | None:
        rep = stream.report
        if rep is None:
            return None
        for k, attr in (("prompt", None), ("reused", "reused_tokens"), ("recomputed", "recomputed_tokens"),
                        ("prefilled", "prefilled_tokens")):
            tokens[k] += len(stream.prompt_ids) if attr is None else getattr(rep, attr)
        return {"reused_tokens": rep.reused_tokens, "recomputed_tokens": rep.recomputed_tokens,
                "prefilled_tokens": rep.prefilled_tokens, "compiled_tokens": rep.compiled_tokens,
                "span_hits": rep.hits, "span_misses": rep.misses, "policy": rep.policy, "ratio": rep.ratio}

    async def run(make, body: dict, route: str, chat: bool):
        """Build the Stream on the engine thread, then answer, streaming or not."""
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            stream: Stream = await loop.run_in_executor(worker, make)
        except PromptTooLongError as exc:
            return fail(413, str(exc), route, "messages")
        except (InputError, ConfigError) as exc:
            return fail(422, str(exc), route)
        except ContextKitError as exc:
            return fail(500, str(exc), route)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if not body.get("stream"):
            gen = await loop.run_in_executor(worker, stream.finish)
            first(gen.prefill_ms / 1e3)
            count(route, 200)
            choice = ({"index": 0, "message": {"role": "assistant", "content": gen.text}} if chat
                      else {"index": 0, "text": gen.text})
            out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                   "model": served_name, "choices": [{**choice, "finish_reason": gen.finish_reason, "logprobs": None}],
                   "usage": usage(stream, len(gen.token_ids))}
            ext = extension(stream)
            if ext:
                out["contextkit"] = ext
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
        count(route, 200)

        async def events():
            seen_first = False
            obj = "chat.completion.chunk" if chat else "text_completion"
            while True:
                item = await queue.get()
                if item is _DONE:
                    break
                if isinstance(item, Exception):
                    yield sse(error_body(500, str(item)))
                    break
                if not seen_first:
                    first(time.perf_counter() - t0)
                choice = ({"index": 0, "delta": ({"role": "assistant"} if not seen_first else {}) | {"content": item}}
                          if chat else {"index": 0, "text": item})
                seen_first = True
                yield sse({"id": rid, "object": obj, "created": created, "model": served_name,
                           "choices": [{**choice, "finish_reason": None, "logprobs": None}]})
            await fut
            gen = stream.result
            if gen is not None:
                end = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
                yield sse({"id": rid, "object": obj, "created": created, "model": served_name,
                           "choices": [{**end, "finish_reason": gen.finish_reason, "logprobs": None}]})
                last = {"id": rid, "object": obj, "created": created, "model": served_name, "choices": [],
                        "usage": usage(stream, len(gen.token_ids))}
                ext = extension(stream)
                if ext:
                    last["contextkit"] = ext
                yield sse(last)
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return fail(exc.status, str(exc), request.url.path, exc.param)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_name, "object": "model", "owned_by": "contextkit",
                                            "max_model_len": kit.engine.spec.max_positions}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_json(request)
        ids = kit.tokenizer.encode(str(body.get("prompt", "")), add_special_tokens=bool(body.get("add_special_tokens", False)))
        return {"tokens": ids, "count": len(ids), "max_model_len": kit.engine.spec.max_positions}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        route = "/v1/chat/completions"
        body = await body_json(request)
        params = _params(body)
        msgs = body.get("messages")
        if "documents" in body or "contextkit" in body:
            req = parse({k: v for k, v in body.items()}, OPTIONS | {"reuse"})
            reuse = _reuse((body.get("contextkit") or {}).get("reuse"))
            system = next((m.get("content") for m in req.messages if m.get("role") == "system"), None)
            question = [m for m in req.messages if m.get("role") == "user"][-1]["content"]
            return await run(lambda: kit.stream(question, req.documents, system, params, reuse, req.tenant),
                             body, route, chat=True)
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise RequestError(422, "messages must be a non-empty list of {role, content} objects", "messages")

        def make() -> Stream:
            text = kit.tokenizer.render_chat([{"role": m["role"], "content": m.get("content") or ""} for m in msgs])
            return Stream(kit.engine, kit.tokenizer, kit.tokenizer.encode(text), params)

        return await run(make, body, route, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_json(request)
        params = _params(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            make = lambda: Stream(kit.engine, kit.tokenizer, kit.tokenizer.encode(prompt, True), params)  # noqa: E731
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            make = lambda: Stream(kit.engine, kit.tokenizer, prompt, params)  # noqa: E731
        else:
            raise RequestError(422, "prompt must be a string or a list of token ids", "prompt")
        return await run(make, body, "/v1/completions", chat=False)

    @app.get("/metrics")
    async def metrics():
        p = "contextkit_serve"
        out = counts.lines() + ttft.lines()
        out.append(f"# TYPE {p}_span_tokens_total counter")
        out += [f'{p}_span_tokens_total{{kind="{k}"}} {v}' for k, v in tokens.items()]
        return PlainTextResponse("\n".join(out) + "\n" + kit.spans.store.kv.prometheus())

    app.state.kit = kit
    return app
