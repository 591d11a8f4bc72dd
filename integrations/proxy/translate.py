"""A vLLM ``text_completion`` answer as the ``chat.completion`` the client asked for, whole or streamed,
with contextkit's extension field (``documents.extension``)."""

from __future__ import annotations

import json

from contextkit.core.plan import RequestPlan
from contextkit.integrations.edge.answers import chunk, completion, sse
from contextkit.integrations.proxy.exchange import Exchange
from contextkit.integrations.proxy.relay import Upstreams, echo_id, proxy_ms, streamed
from contextkit.integrations.proxy.upstreams import Upstream


def extension(plan: RequestPlan, u: Upstream, usage: dict | None = None, reuse: dict | None = None,
              agents: dict | None = None) -> dict:
    """The answer's ``contextkit`` field: the order served, where it ran, what was cached and reused, and
    parallel agents' fields (``agents.agents_report``)."""
    out = {"order": list(plan.document_ids), "reordered": plan.reordered,
           "expected_cached_tokens": plan.expected_cached_tokens, "upstream": u.name, "tenant": plan.tenant.name,
           "padding_tokens": plan.padding_tokens, "prompt_tokens": plan.num_tokens}
    skills = [it.span.name for it in plan.items if it.span.kind == "skill" and it.reuse]
    if skills:
        out["skills"] = skills  # name@version, in the order rendered
    if usage is not None:
        out["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if reuse is not None:
        out["reuse"] = reuse
    return {**out, **(agents or {})}


def _chat_id(obj: dict) -> str:
    return "chatcmpl-" + str(obj.get("id", "")).removeprefix("cmpl-")


def chat_from_completion(resp: dict, ext: Exchange) -> dict:
    """A ``text_completion`` response as a ``chat.completion`` one, with our extension field."""
    rid = _chat_id(resp)
    choices = [(c.get("index", 0), c.get("text", ""), c.get("finish_reason"),
                {"prompt_token_ids": c["prompt_token_ids"]} if "prompt_token_ids" in c else {})  # return_token_ids
               for c in resp.get("choices") or ()]
    return completion(rid, resp.get("model"), True, choices, resp.get("usage") or None, ext, resp.get("created"))


async def translate_stream(ups: Upstreams, u: Upstream, resp, plan: RequestPlan, receive, send, t: Exchange,
                           reuse: dict | None = None, agents: dict | None = None) -> None:
    """Relay a streamed completion as chat chunks (``relay.streamed`` handles hang-ups and failures)."""
    t.status = 200
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), proxy_ms(t),
                            *echo_id(t)]})
    seen: set[int] = set()
    async with streamed(u, resp, receive, send) as stream:
        async for raw in resp.content:  # lines
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                await send({"type": "http.response.body", "body": sse("[DONE]"), "more_body": True})
                stream.done = True
                break
            obj = json.loads(data)
            deltas = []
            for c in obj.get("choices") or ():
                i = c.get("index", 0)
                deltas.append((i, c.get("text", ""), i not in seen, c.get("finish_reason")))
                seen.add(i)
            if deltas and t.upstream_first is None:
                ups.first_bytes(t)
            use = obj.get("usage")
            ups.metrics.usage(use)
            out = chunk(_chat_id(obj), obj.get("model"), True, deltas,
                        obj.get("created"), use, extension(plan, u, use, reuse, agents) if use else None)
            await send({"type": "http.response.body", "body": sse(out), "more_body": True})
