"""The proxy's documents route: a chat request carrying ``documents`` (or ``contextkit`` options).

The request goes through the one planner (``contextkit.core.planner``): rendered as stable token
segments, ordered by the chosen upstream's Weaver for the tenant, block-aligned if asked, length-checked
against the upstream's context. It is sent to the upstream's ``/v1/completions`` as token ids (so the
segments stay as tokenized, which is what lets the prefix cache hit) with the tenant's ``cache_salt``,
and the completion is translated back into a chat completion, streamed or not, carrying a
``contextkit`` field (the order, whether it was reordered, the prompt tokens served from cache). The
served order is recorded in the upstream's tree only once the upstream has accepted the request.

With ``kv_connector`` set, a request may opt in to position-independent span reuse (``spans.py``): it
goes with its spans in ``kv_transfer_params`` under a ``cache_salt`` of its own, its order is not recorded
(it is not an exact prefix), and spans new to the upstream are compiled after it.

Planning tokenizes every document (up to ``max_body_bytes`` of text): it runs off the event loop
(``Planning``), so the streams the proxy relays keep flowing while a large request is planned.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging

from contextkit.core.errors import ConfigError, PromptTooLongError
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import FixedOrder, Planner
from contextkit.core.tenancy import Tenancy
from contextkit.core.tenant import Tenant
from contextkit.integrations.edge.answers import chunk, completion, sse
from contextkit.integrations.edge.parse import parse_chat
from contextkit.integrations.edge.shapes import SAMPLING, ChatBody
from contextkit.integrations.proxy.kv_index import keys_by, prompt_keys
from contextkit.integrations.proxy.relay import (
    UPSTREAM_ERRORS,
    Upstreams,
    echo_id,
    proxy_ms,
    read_error,
    send_json,
    streamed,
    upstream_request_id,
)
from contextkit.integrations.proxy.planning import Planning
from contextkit.integrations.proxy.routing import Choice, Routed, session_key
from contextkit.integrations.proxy.span_compiler import (
    check_options,
    pic_params,
    pic_salt,
    segments_of,
    spans_of,
    uses_spans,
)
from contextkit.integrations.proxy.upstreams import Upstream
from contextkit.integrations.vllm_connector.cacheblend import blend_prompt_ids, refuse_unasked_blend
from contextkit.integrations.vllm_connector.wire import ConnectorAnswer
from contextkit.ordering.event_order import SearchLimits, event_order

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


def extension(plan: RequestPlan, u: Upstream, usage: dict | None = None, reuse: dict | None = None) -> dict:
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
    return out


async def documents(ups: Upstreams, planner: Planner, tenancy: Tenancy, tenant: Tenant, scope, receive, send,
                    body: dict, t: dict, planning: Planning | None = None) -> None:
    """Answer a documents request for ``tenant`` (its key's; errors raised before the response starts are
    the caller's to send). The planner runs on ``planning``'s threads (None: the loop's default executor,
    still off the loop)."""
    # the key's tenant owns the planning slots (its sub-tenants share them): fair between keys
    off_loop = functools.partial(planning.run, owner=tenant.name) if planning is not None else asyncio.to_thread
    connector = ups.settings.kv_connector
    chat, request = parse_chat(body, lambda name: tenancy.resolve(tenant, name), allow_reuse=connector != "none",
                               reuse_default=False)
    if request.reuse is not None:
        check_options(connector, chat.contextkit.reuse.model_dump(exclude_none=True))
    await off_loop(planner.docs, request)  # tokenizes every document (cached for the plans): never on the loop
    salt = tenancy.cache_salt(request.tenant)
    spans = connector == "contextkit" and uses_spans(request.reuse)
    sent_salt = pic_salt(salt, request.reuse) if spans else salt
    routed, plan = await place(ups, planner, request, sent_salt, off_loop, session=session_key(body, salt))
    u = routed.choice.upstream
    ups.metrics.reorders.labels("reordered" if plan.reordered else "kept").inc()
    out = completion_body(body, chat, plan, salt)
    reuse = None
    if spans:  # span reuse: its own salt, its spans and recompute named
        out["kv_transfer_params"] = pic_params(plan, salt, request.reuse)
        out["cache_salt"] = pic_salt(salt, request.reuse)
        reuse = {"path": "connector", "spans": len(out["kv_transfer_params"]["contextkit"]["spans"])}
    elif connector == "contextkit" and request.reuse is not None:  # policy "full": an exact request
        reuse = {"path": "connector", "policy": "full"}
    elif request.reuse is not None:  # CacheBlend: segments joined by LMCache's separator
        segments = segments_of(plan)
        out["prompt"] = blend_prompt_ids(segments, ups.blend_separator(planner.tokenizer))
        reuse = {"path": "cacheblend", "segments": len(segments)}
    elif connector == "cacheblend":  # not opted in: the blending upstream must find no separator in it
        refuse_unasked_blend(prompt_ids=plan.ids, separator=ups.settings.cacheblend_separator,
                             separator_ids=ups.blend_separator(planner.tokenizer))
    # the token ids as JSON: ~0.2 s for 1M ids, so a large prompt is serialized off the loop
    payload = json.dumps(out).encode() if plan.num_tokens < ENCODE_ON_LOOP else await off_loop(_encode, out)
    sent = ups.router.sent(u, routed.keys)
    with ups.pool.lease(u):
        rid = t.setdefault("request_id", upstream_request_id())  # the proxy's, never the client's
        headers = {"content-type": "application/json", "x-request-id": rid}
        resp = await ups.start(u, "POST", "/v1/completions", headers, payload, t)
        ups.router.accepted(sent, resp.status)  # vLLM took it (2xx): its KV events are due
        if resp.status != 200:  # the upstream refused the request: its own error, as it is
            status, text = resp.status, await read_error(resp)
            t["status"] = status
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"), *echo_id(t)]})
            await send({"type": "http.response.body", "body": text.encode()})
            return
        if request.reuse is None or (connector == "contextkit" and not spans):  # an exact request (or "full")
            u.weaver.record(plan.served, plan.tenant)  # accepted: its prefix cache now holds this order
        if chat.stream:
            if spans:  # a stream carries no kv_transfer_params: compile every span this proxy has not
                ups.compiler.schedule(u.url, chat.model, salt, [plan.ids[s:e] for s, e in spans_of(plan)],
                                      tenant=plan.tenant)
            return await translate_stream(ups, u, resp, plan, receive, send, t, reuse)
        try:
            obj = json.loads(await resp.read())
        except (*UPSTREAM_ERRORS, ValueError) as exc:
            resp.close()
            raise ups.failure(u, exc) from None
        resp.release()
    ups.first_bytes(t)
    ups.metrics.usage(obj.get("usage"))
    if spans:
        reuse = {**reuse, **connector_report(ups, u, chat.model, salt, plan, obj.get("kv_transfer_params"),
                                                 obj.get("usage"))}
    await send_json(send, t, 200, chat_from_completion(obj, extension(plan, u, obj.get("usage") or {}, reuse)),
                    [proxy_ms(t)])


async def place(ups: Upstreams, planner: Planner, request, salt: str, off_loop,
                session: bytes | None = None) -> tuple[Routed, RequestPlan]:
    """Choose the upstream for a documents request and its plan there. Each upstream's Weaver may order the
    documents differently, so the request is planned once per distinct order and each plan is scored
    against the upstream it was made for: by that upstream's KV events (the blocks it holds under the
    request's ``salt``), else by its Weaver's estimate."""
    pool = ups.pool.healthy()
    if not pool:
        ups.least_loaded()  # raises the 503
    limits = await asyncio.gather(*(ups.model_len(u) for u in pool))
    if len(pool) == 1:
        plan = await off_loop(planner.plan, request, pool[0].weaver, context_limit=limits[0])
        return Routed(Choice(pool[0], "single")), plan
    router = ups.router
    depth = router.depth_reader([router.position(u) for u in pool])
    plans, keys, (alt, alt_keys, search) = await off_loop(plan_each, planner, request, pool, limits, salt=salt,
                                                          depth=depth, search_limits=ups.search_limits)
    if search is not None:
        ups.metrics.event_order(search)
    events, model, scored = {}, {}, {}
    alt_held = router.held(alt_keys) if alt is not None else {}  # the order the fleet's events found
    for at, (u, plan, k) in enumerate(zip(pool, plans, keys)):
        if plan is not None:
            i = router.position(u)
            if k not in scored:  # upstreams whose Weavers chose the same order share one fleet pass
                scored[k] = router.held(k)
            events[i] = scored[k].get(i, 0)
            model[i] = (plan.expected_cached_tokens or 0) // ups.settings.block_size
            if alt_held.get(i, 0) > events[i]:  # used where it holds more than the Weaver's order
                plans[at], keys[at], events[i] = alt, alt_keys, alt_held[i]
    choice = router.pick([u for u, p in zip(pool, plans) if p is not None], events=events, model=model,
                         blocks=max(len(k) for k in keys), session=session)
    at = pool.index(choice.upstream)
    return Routed(choice, keys[at]), plans[at]


def plan_each(planner: Planner, request, pool: list[Upstream], limits: list[int | None], *, salt: str,
              depth=None, search_limits: SearchLimits = SearchLimits()
              ) -> tuple[list[RequestPlan | None], list[tuple[bytes, ...]], tuple]:
    """The request planned with each upstream's Weaver and its prompt's block keys (one plan per distinct
    order and limit), and (plan, keys, search) of the order the fleet's events hold deepest (``depth``: the
    router's reader; None, or no such order: (None, (), the search or None)), searched within
    ``search_limits``. An upstream whose context the prompt does not fit gets None; none fitting raises."""
    made: dict = {}
    plans, keys = [], []
    error = None
    docs = planner.docs(request)
    for u, limit in zip(pool, limits):
        result = u.weaver.order(docs, request.tenant, record=False)
        order = result.order
        if (order, limit) not in made:
            try:  # the Weaver's answer as it gave it (planning with the Weaver would ask it again)
                plan = planner.plan(request, FixedOrder(order, result.reusable_tokens), context_limit=limit)
                made[order, limit] = plan, tuple(prompt_keys(plan.ids, block_size=planner.block_size, salt=salt))
            except PromptTooLongError as exc:
                made[order, limit], error = (None, ()), exc
        plans.append(made[order, limit][0])
        keys.append(made[order, limit][1])
    if all(p is None for p in plans):
        raise error
    alt, search = None, None
    if depth is not None:
        fits = [limit for limit, p in zip(limits, plans) if p is not None]
        limit = min(fits, default=None) if None not in fits else None
        alt, search = event_order(planner, request, depth=depth, block_size=planner.block_size,
                                  keys_of=keys_by(salt=salt, block_size=planner.block_size),
                                  context_limit=limit, limits=search_limits)
    alt_keys = tuple(prompt_keys(alt.ids, block_size=planner.block_size, salt=salt)) if alt is not None else ()
    return plans, keys, (alt, alt_keys, search)


def connector_report(ups: Upstreams, u: Upstream, model: str | None, salt: str, plan: RequestPlan,
                     params: dict | None, usage: dict | None = None) -> dict:
    """What the connector says it loaded and recomputed. Spans it saved out of this request (those the store
    lacked, computed here in context) need no compile; the others this proxy has not compiled are
    compiled after the answer, and those it found missing (evicted) compiled again."""
    try:
        got = ConnectorAnswer.of(params) or ConnectorAnswer()
    except ConfigError as exc:  # a connector of another release: nothing of its answer is read
        log.warning({"event": "connector answer refused", "upstream": u.name, "why": str(exc)})
        got = ConnectorAnswer()
    missing, saved, ids = set(got.missing_spans), set(got.saved_spans), plan.ids
    for s, e in saved:
        ups.compiler.remember(u.url, salt, ids[s:e])
    for s, e in missing - saved:
        ups.compiler.forget(u.url, salt, ids[s:e])
    ups.compiler.schedule(u.url, model, salt, [ids[s:e] for s, e in spans_of(plan) if (s, e) not in saved],
                          tenant=plan.tenant)
    out = {"loaded_tokens": got.loaded_tokens, "missing_spans": len(missing), "saved_spans": len(saved)}
    rec = got.recompute
    if rec is not None:  # what the connector resolved and recomputed, as serve reports it
        loaded, n = got.loaded_tokens, rec.get("recomputed_tokens") or 0
        reported = ("policy", "ratio", "probe_layers", "fidelity_budget", "profile", "band", "requested", "reason",
                    "clamped", "limits")  # clamped / limits: the connector's operator limits cut the setting
        out.update({k: rec[k] for k in reported if k in rec})
        cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        out.update(recomputed_tokens=n, reused_tokens=max(0, loaded - n))
        if isinstance(cached, int):  # vLLM computed the rest of the prompt (the question, spans not loaded)
            out["prefilled_tokens"] = max(0, plan.num_tokens - cached)
    return out


def _chat_id(obj: dict) -> str:
    return "chatcmpl-" + str(obj.get("id", "")).removeprefix("cmpl-")


def chat_from_completion(resp: dict, ext: dict) -> dict:
    """A ``text_completion`` response as a ``chat.completion`` one, with our extension field."""
    rid = _chat_id(resp)
    choices = [(c.get("index", 0), c.get("text", ""), c.get("finish_reason"),
                {"prompt_token_ids": c["prompt_token_ids"]} if "prompt_token_ids" in c else {})  # return_token_ids
               for c in resp.get("choices") or ()]
    return completion(rid, resp.get("model"), True, choices, resp.get("usage") or None, ext, resp.get("created"))


async def translate_stream(ups: Upstreams, u: Upstream, resp, plan: RequestPlan, receive, send, t: dict,
                           reuse: dict | None = None) -> None:
    """Relay a streamed completion as chat chunks (``relay.streamed`` handles hang-ups and failures)."""
    t["status"] = 200
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
            if deltas and "upstream_first" not in t:
                ups.first_bytes(t)
            use = obj.get("usage")
            ups.metrics.usage(use)
            out = chunk(_chat_id(obj), obj.get("model"), True, deltas,
                        obj.get("created"), use, extension(plan, u, use, reuse) if use else None)
            await send({"type": "http.response.body", "body": sse(out), "more_body": True})
