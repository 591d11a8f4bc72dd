"""serve's answer to one started request: the whole completion, or its server-sent events, with the usage
and the ``contextkit`` report (reuse, order, kept handles) that close it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from contextkit.integrations.edge.answers import chunk, completion, error_body, sse, usage
from contextkit.integrations.serve.engine_turns import Job
from contextkit.integrations.serve.kept import Turn

if TYPE_CHECKING:  # types only: serve's app and the kit import the engine, this module need not
    from contextkit.integrations.serve.app import ServeApp
    from contextkit.kit import KitStream


class StartedAnswer:
    """The answer to one started request (``stream``): the whole completion, or its SSE events."""

    def __init__(self, server: ServeApp, stream: KitStream, chat: bool, return_token_ids: bool | None, turn: Turn):
        self.server, self.stream, self.chat, self.turn = server, stream, chat, turn
        self.rid, self.created = turn.rid, int(time.time())
        self.ids = {"prompt_token_ids": list(stream.prompt_ids)} if return_token_ids else {}

    def _usage(self, completion_tokens: int) -> dict:
        rep = self.stream.report
        cached = rep.cached_tokens if rep else 0  # KV that existed before this request
        return usage(len(self.stream.prompt_ids), completion_tokens, cached)

    def _extension(self) -> dict | None:
        stream, rep = self.stream, self.stream.report
        if rep is None:
            return self.turn.extension() or None
        span_tokens = self.server.span_tokens
        span_tokens.labels("prompt").inc(len(stream.prompt_ids))
        for kind in ("reused", "recomputed", "prefilled"):
            span_tokens.labels(kind).inc(getattr(rep, f"{kind}_tokens"))
        return {"reused_tokens": rep.reused_tokens, "cached_tokens": rep.cached_tokens,
                "recomputed_tokens": rep.recomputed_tokens,
                "prefilled_tokens": rep.prefilled_tokens, "compiled_tokens": rep.compiled_tokens,
                "exact_tokens": rep.exact_tokens,
                "span_hits": rep.hits, "span_misses": rep.misses, "policy": rep.policy, "ratio": rep.ratio,
                "probe_layers": rep.probe_layers, "first_k": rep.first_k,
                "fidelity_budget": rep.fidelity_budget, "profile": rep.profile, "band": rep.band,
                "tail_gate": rep.tail_gate, "escalated": rep.escalated,
                "order": list(stream.plan.document_ids), "reordered": stream.plan.reordered,
                **self.turn.extension()}

    async def whole(self, job: Job, request: Request, route: str) -> Response:
        metrics, name = self.server.metrics, self.server.served_name
        try:
            while (item := await job.next_or_disconnect(request))[0] == "delta":
                pass
        finally:
            job.cancel.set()  # client gone or finished: nothing more to decode
        if item[0] == "error":
            raise item[1]
        gen = self.stream.result
        if gen is None:  # the client hung up: nobody reads this
            metrics.request(route, 499)
            return Response(status_code=499)
        metrics.first_token(gen.prefill_ms / 1e3)
        metrics.request(route, 200)
        out = completion(self.rid, name, self.chat, [(0, gen.text, gen.finish_reason, self.ids)],
                         self._usage(len(gen.token_ids)), self._extension(), self.created)
        return JSONResponse(out)

    async def events(self, job: Job, t0: float):
        rid, name, chat, created = self.rid, self.server.served_name, self.chat, self.created
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
                    self.server.metrics.first_token(time.perf_counter() - t0)
                out = chunk(rid, name, chat, [(0, item, first, None)], created)
                if first:
                    out["choices"][0].update(self.ids)  # vLLM sends the prompt's ids with the first delta
                first = False
                yield sse(out)
            gen = self.stream.result
            if gen is not None:
                yield sse(chunk(rid, name, chat, [(0, "", first, gen.finish_reason)], created))
                yield sse(chunk(rid, name, chat, [], created, self._usage(len(gen.token_ids)), self._extension()))
            yield sse("[DONE]")
        finally:  # the client hung up (the generator is closed) or the stream ended
            job.cancel.set()
