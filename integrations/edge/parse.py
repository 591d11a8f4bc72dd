"""Reading and checking a request body: the bytes (bounded), the JSON, the values JSON lets through
that the tokenizer cannot take, and a chat body turned into the planner's ``ChatRequest``. Every
problem is an ``InputError`` naming the field (or a ``MalformedBodyError`` / ``BodyTooLargeError``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from contextkit.core.errors import BodyTooLargeError, ConfigError, InputError, MalformedBodyError  # fmt: skip
from contextkit.core.planner import ChatRequest
from contextkit.core.policy import ReuseOptions
from contextkit.core.tenant import Tenant
from contextkit.core.types import Evidence, Message, Skill, skill_version
from contextkit.integrations.edge.shapes import ChatBody, ContextkitOptions, ReuseIn, check_utf8


def validate(model: type[BaseModel], body: dict) -> Any:
    """``body`` as ``model``, or an ``InputError`` naming the first field to fix."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


class ClientGone(Exception):
    """The client hung up before its request body arrived."""


async def read_body(receive, limit: int, declared: str | bytes | None = None) -> bytes:
    """The whole request body; ``BodyTooLargeError`` once it passes ``limit`` bytes, or at once when its
    ``Content-Length`` (``declared``) says it will (a client sending 8 MiB bodies in a loop cost the event
    loop every byte of them before)."""
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise MalformedBodyError("Content-Length is not a number") from None
        if size > limit:
            raise BodyTooLargeError(f"request body of {size} bytes is over the limit of {limit} bytes")
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise BodyTooLargeError(f"request body is over the limit of {limit} bytes")
        parts.append(part)
        if not message.get("more_body"):
            return b"".join(parts)


def json_body(raw: bytes) -> dict:
    """A request body as a JSON object, or a ``MalformedBodyError`` (400)."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as exc:
        where = f" ({exc.msg} at position {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        raise MalformedBodyError(f"request body is not valid JSON{where}") from exc
    if not isinstance(body, dict):
        raise MalformedBodyError("request body must be a JSON object")
    check_values(raw, body)
    return body


_SUSPECT = re.compile(rb"\\u[dD][89a-fA-F]|\d{19}")  # a surrogate escape, or a number of 19+ digits
INT64 = 1 << 63


def check_values(raw: bytes, parsed) -> None:
    """Refuse a JSON body holding a lone surrogate (``"\\ud800"``: valid JSON, not valid UTF-8) or an
    integer outside 64 bits (vLLM cannot pass one to its engine and answers 500) anywhere in it. Only a
    body whose bytes hold either at all is walked."""
    if not _SUSPECT.search(raw):
        return
    stack = [parsed]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            _utf8_or_input_error(v)
        elif type(v) is int and not -INT64 <= v < INT64:
            raise InputError(f"the integer {str(v)[:30]}... in the request body does not fit in 64 bits")
        elif isinstance(v, dict):
            for k, item in v.items():
                _utf8_or_input_error(k)
                stack.append(item)
        elif isinstance(v, list):
            stack.extend(v)


def _utf8_or_input_error(v: str) -> None:
    try:
        check_utf8(v)
    except ValueError as exc:
        raise InputError(f"a string in the request body {exc}") from None


def _validation_error(exc: ValidationError) -> InputError:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    param = str(err["loc"][0]) if err["loc"] else None
    if err["type"] == "extra_forbidden":
        known = sorted(ChatBody.model_fields) if len(err["loc"]) == 1 else None
        hint = f"; accepted: {known}" if known else ""
        return InputError(f"unknown fields [{loc!r}] in a documents request{hint}", param)
    return InputError(f"{loc}: {err['msg']}", param)


def reuse_options(fields: ReuseIn | dict[str, Any] | None) -> ReuseOptions:
    """``contextkit.reuse`` as ReuseOptions (the request's KV-path reuse); the fields not sent keep
    ReuseOptions' defaults."""
    if fields is None:
        return ReuseOptions()
    if isinstance(fields, dict):
        try:
            fields = ReuseIn.model_validate(fields)
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise InputError(f"contextkit.reuse.{loc}: {err['msg']}", "contextkit") from None
    given = {k: v for k, v in fields.model_dump(exclude_none=True).items()}
    if "separator" in given:
        given["separator"] = tuple(given["separator"])
    try:
        return ReuseOptions(**given)
    except ConfigError as exc:
        raise InputError(f"contextkit.reuse: {exc}", "contextkit") from exc


def parse_chat(body: dict, tenant: Callable[[str | None], Tenant], *, allow_reuse: bool = False,
               default_max_tokens: int = 16, reuse_default: bool = True) -> tuple[ChatBody, ChatRequest]:
    """A chat body checked and turned into the planner's request (tenant, ordering, reuse and all).

    ``tenant`` maps the body's ``contextkit.tenant`` (None when absent) to the tenant the request runs as:
    a server's ``Tenancy.resolve`` for the request's key (it refuses names the key may not use).
    ``reuse_default``: a request with documents, skills or earlier turns and no ``contextkit.reuse`` reuses
    them with the default options (serve's KV path; earlier turns only as an exact prefix); False: only a
    request that asks (the proxy's connector path, opt-in).
    """
    chat: ChatBody = validate(ChatBody, body)
    opts = chat.contextkit or ContextkitOptions()
    if opts.reuse is not None and not allow_reuse:
        raise InputError("contextkit.reuse applies to contextkit serve (the KV path) and to a proxy whose "
                         "upstreams run the contextkit KV connector (--kv-connector); this one sends prompts",
                         "contextkit")
    messages = tuple(Message(m.role, m.text()) for m in chat.messages)
    docs = tuple(Evidence(d.text, id=None if d.id is None else str(d.id), title=d.title) for d in chat.documents or ())
    skills = tuple(Skill(k.name, k.text, skill_version(k.name, k.text)) for k in chat.skills or ())
    try:
        runs_as = tenant(opts.tenant)
    except InputError as exc:
        raise InputError(f"contextkit.tenant: {exc}", "contextkit") from None
    # the KV path (serve) reuses documents and skills as spans, and a conversation's earlier turns as an
    # exact prefix, unless told otherwise; a single-turn chat without them is a plain prefill
    turns = any(m.role in ("assistant", "tool") for m in messages)
    named = bool(opts.handles) or any(d.handle is not None for d in chat.documents or ())  # kept answers
    wants = opts.reuse is not None or (reuse_default and bool(docs or skills or turns or named))
    reuse = reuse_options(opts.reuse) if allow_reuse and wants else None
    request = ChatRequest(messages, docs, skills, runs_as, opts.ordering, opts.block_align, reuse,
                          chat.new_tokens or default_max_tokens, documents_at=opts.documents_at)
    return chat, request


def named_handles(chat: ChatBody) -> list[Any] | str:
    """The kept answers a chat names (``contextkit.handles``, then each document's ``handle``), as sent:
    ``synthesis.splice.splice`` reads each one or says why not; ``"auto"`` as sent (the tenant's recent
    ones, found by their text)."""
    opts = chat.contextkit or ContextkitOptions()
    if isinstance(opts.handles, str):
        return opts.handles
    return [*(opts.handles or ()), *(d.handle for d in chat.documents or () if d.handle is not None)]


# -- responses --------------------------------------------------------------------------------------


