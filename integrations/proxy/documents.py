"""The proxy's documents route: a chat request carrying ``documents`` (or ``contextkit`` options).

The request goes through the one planner (``contextkit.core.planner``): rendered as stable token
segments, ordered by the chosen upstream's Weaver for the tenant, block-aligned if asked, length-checked
against the upstream's context. It is sent to the upstream's ``/v1/completions`` as token ids (so the
segments stay as tokenized, which is what lets the prefix cache hit) with the tenant's ``cache_salt``,
and the completion is translated back into a chat completion, streamed or not, carrying a
``contextkit`` field (the order, whether it was reordered, the prompt tokens served from cache). The
served order is recorded in the upstream's tree only once the upstream has accepted the request.

With ``kv_connector`` set, a request may opt in to KV reuse; what that does is the upstreams' reuse path's
(``reuse_paths.py``: span reuse through the contextkit connector, or LMCache's CacheBlend), chosen at start.
Where it goes and in which order is ``placement.py``'s; the answer's translation back into a chat
completion, ``translate.py``'s.

Planning tokenizes every document (up to ``max_body_bytes`` of text): it runs off the event loop
(``Planning``), so the streams the proxy relays keep flowing while a large request is planned.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

from contextkit.core.plan import RequestPlan
from contextkit.core.planner import Planner
from contextkit.core.tenancy import Tenancy
from contextkit.core.tenant import Tenant
from contextkit.integrations.edge.parse import parse_chat
from contextkit.integrations.edge.shapes import SAMPLING, ChatBody
from contextkit.integrations.proxy.agents import agents_report
from contextkit.integrations.proxy.exchange import Exchange
from contextkit.integrations.proxy.placement import place
from contextkit.integrations.proxy.planning import Planning
from contextkit.integrations.proxy.relay import UPSTREAM_ERRORS, Upstreams, echo_id, proxy_ms, read_error, send_json
from contextkit.integrations.proxy.routing import session_key
from contextkit.integrations.proxy.translate import chat_from_completion, extension, translate_stream

log = logging.getLogger("contextkit.proxy")

ENCODE_ON_LOOP = 32_768  # prompt tokens: a smaller completion body costs less to serialize than a thread hop


def _encode(body: dict) -> bytes:
    return json.dumps(body).encode()


def completion_body(body: dict, chat: ChatBody, plan: RequestPlan, salt: str) -> dict:
    """The ``/v1/completions`` request for a planned chat: the client's sampling fields as they are."""
    out = {k: body[k] for k in SAMPLING if k in body}
    if chat.max_completion_tokens is not None and chat.max_tokens is None:
        out["max_tokens"] = chat.max_completion_tokens
    out.update(model=chat.model, prompt=plan.ids)
    if chat.return_token_ids:
        out["return_token_ids"] = True
    if out.get("stream"):
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    out["cache_salt"] = salt
    return out


async def documents(ups: Upstreams, planner: Planner, tenancy: Tenancy, tenant: Tenant, scope, receive, send,
                    body: dict, t: Exchange, planning: Planning | None = None) -> None:
    """Answer a documents request for ``tenant`` (its key's; errors raised before the response starts are
    the caller's to send). The planner runs on ``planning``'s threads (None: the loop's default executor,
    still off the loop); what an opt-in to reuse does is the upstreams' reuse path's (``ups.reuse``)."""
    # the key's tenant owns the planning slots (its sub-tenants share them): fair between keys
    off_loop = functools.partial(planning.run, owner=tenant.name) if planning is not None else asyncio.to_thread
    path = ups.reuse
    chat, request = parse_chat(body, lambda name: tenancy.resolve(tenant, name), allow_reuse=path.allows_reuse,
                               reuse_default=False)
    if request.reuse is not None:
        path.check(chat.contextkit.reuse.model_dump(exclude_none=True))
    await off_loop(planner.docs, request)  # tokenizes every document (cached for the plans): never on the loop
    salt = tenancy.cache_salt(request.tenant)
    routed, plan = await place(ups, planner, request, path.salt(salt, request.reuse), off_loop,
                               session=session_key(body, salt))
    u = routed.choice.upstream
    ups.metrics.reorders.labels("reordered" if plan.reordered else "kept").inc()
    out = completion_body(body, chat, plan, salt)
    sent = path.prepare(out, plan, salt, request.reuse, ups=ups, tokenizer=planner.tokenizer)
    # the token ids as JSON: ~0.2 s for 1M ids, so a large prompt is serialized off the loop
    payload = json.dumps(out).encode() if plan.num_tokens < ENCODE_ON_LOOP else await off_loop(_encode, out)
    ticket = ups.router.sent(u, routed.keys)
    with ups.pool.lease(u):
        headers = {"content-type": "application/json", "x-request-id": t.request_id}  # the proxy's id
        resp = await ups.start(u, "POST", "/v1/completions", headers, payload, t)
        ups.router.accepted(ticket, resp.status)  # vLLM took it (2xx): its KV events are due
        if resp.status != 200:  # the upstream refused the request: its own error, as it is
            status, text = resp.status, await read_error(resp)
            t.status = status
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), *echo_id(t)]})
            await send({"type": "http.response.body", "body": text.encode()})
            return
        if sent.exact:
            u.weaver.record(plan.served, plan.tenant)  # accepted: its prefix cache now holds this order
        if chat.stream:
            path.streamed(ups, u, chat.model, salt, plan, sent)
            return await translate_stream(ups, u, resp, plan, receive, send, t, sent.reuse, agents_report(chat))
        try:
            obj = json.loads(await resp.read())
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            resp.close()
            raise ups.failure(u, exc) from None
        resp.release()
    ups.first_bytes(t)
    ups.metrics.usage(obj.get("usage"))
    reuse = path.answered(ups, u, chat.model, salt, plan, sent, obj)
    ext = extension(plan, u, obj.get("usage") or {}, reuse, agents_report(chat))
    await send_json(send, t, 200, chat_from_completion(obj, ext), [proxy_ms(t)])
