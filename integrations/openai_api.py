"""The OpenAI API shapes shared by ``contextkit serve`` and ``contextkit proxy`` (pydantic models).

Requests: a chat completion may carry ``documents`` (vLLM's field: ``{"title", "text"}``, optionally
``"id"``) and ``contextkit`` options (``ordering``: ``weaver`` | ``retrieval``, ``tenant``,
``block_align``; on serve also ``reuse``: the fields of ``ReuseOptions``). ``parse_chat`` checks such a
body and turns it into the planner's ``ChatRequest``; every problem is an ``InputError`` naming the field.
Responses: chat completions, chunks and text completions, with our ``contextkit`` extension field.
Errors: OpenAI error objects, the status decided by ``contextkit.core.errors.http_status``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from contextkit.core.errors import (
    AuthenticationError, BodyTooLargeError, ConfigError, InputError, MalformedBodyError, OverloadedError, http_status,
)  # fmt: skip
from contextkit.core.generation import SamplingParams
from contextkit.core.plan import POLICIES, ReuseOptions
from contextkit.core.planner import ChatRequest
from contextkit.core.tenant import Tenant
from contextkit.core.types import ROLES, Evidence, Message, Skill, skill_version

# chat fields a documents request may carry and the proxy forwards to /v1/completions as they are
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "stream", "stream_options", "user", "logit_bias")


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid UTF-8)") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]  # every string that reaches the tokenizer
MAX_STOP = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)  # name, tool_calls, ...: accepted, not rendered

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Text | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: OpenAI content parts are joined (only text parts are supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise InputError("only text content parts are supported ({\"type\": \"text\", \"text\": ...})",
                                 "messages")
            try:
                parts.append(_utf8(p["text"]))
            except ValueError as exc:
                raise InputError(f"messages: a content part {exc}", "messages") from None
        return "".join(parts)


class DocumentIn(_Strict):
    text: Text = Field(min_length=1)
    title: Text | None = None
    id: Annotated[str, Field(max_length=256)] | int | None = None

    @field_validator("text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty string")
        return v


class SkillIn(_Strict):
    """A skill the request needs: rendered after the system prompt, in one order for every request."""

    name: Annotated[Text, Field(min_length=1, max_length=128)]
    text: Text = Field(min_length=1)

    @field_validator("name", "text")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a non-empty string")
        return v


class ReuseIn(_Strict):
    """``contextkit.reuse``: the fields of ``ReuseOptions``, typed here so a wrong type is a 422 naming the
    field (ReuseOptions checks the ranges that depend on each other). Strict: ``"0.3"`` is not a ratio,
    ``1.5`` not a count, ``1`` not a boolean; a count may still be sent as an integer-valued float."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    policy: Literal[POLICIES] | None = None  # type: ignore[valid-type]
    ratio: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    max_recompute: int | None = Field(None, ge=0)
    fidelity_budget: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    first_k: int | None = Field(None, ge=0, le=1 << 20)
    check_layer: int | None = Field(None, ge=0, le=4096)
    probe_layers: int | None = Field(None, ge=0, le=4096)
    recompute_last_span: bool | None = None
    block_size: int | None = Field(None, ge=0, le=1 << 16)
    separator: list[Annotated[int, Field(ge=0, lt=1 << 31)]] | None = Field(None, max_length=64)


class ContextkitOptions(_Strict):
    ordering: Literal["weaver", "retrieval"] = "weaver"
    tenant: str | None = None  # a sub-tenant, where the server allows client-chosen ones
    block_align: bool = False
    documents_at: Literal["last", "first"] = "last"  # the user message the documents open (a session: first)
    reuse: ReuseIn | None = None  # the KV path only (serve, a proxy with a connector)


class _Sampling(BaseModel):
    """The sampling fields of chat and text completions (vLLM's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # json.loads reads NaN, Infinity

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    stop: Text | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = Field(default=None, ge=0)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool | None = None  # vLLM's name: the response carries the prompt's token ids

    @property
    def new_tokens(self) -> int | None:
        return self.max_tokens or self.max_completion_tokens

    def sampling(self, default_max_tokens: int = 256) -> SamplingParams:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        try:
            return SamplingParams(
                max_new_tokens=self.new_tokens or default_max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=self.top_p or 1.0, top_k=self.top_k or 0, seed=self.seed, stop=stop,
                min_new_tokens=self.min_tokens or 0,
            )  # fmt: skip
        except ConfigError as exc:
            raise InputError(f"sampling parameters: {exc}") from exc


class ChatBody(_Sampling):
    """A chat completion request. Unknown fields are refused when it carries documents (they could not
    be forwarded faithfully as a completion); plain chat passes through the proxy untouched."""

    messages: list[MessageIn] = Field(min_length=1)
    documents: list[DocumentIn] | None = None
    skills: Annotated[list[SkillIn], Field(max_length=64)] | None = None
    contextkit: ContextkitOptions | None = None


class CompletionBody(_Sampling):
    """A text completion request (``contextkit serve``; the proxy passes these through)."""

    prompt: Text | list[Annotated[int, Field(ge=0)]] = Field(min_length=1)


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
        _utf8(v)
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
    docs = tuple(Evidence(d.text, None if d.id is None else str(d.id), d.title) for d in chat.documents or ())
    skills = tuple(Skill(k.name, k.text, skill_version(k.name, k.text)) for k in chat.skills or ())
    try:
        runs_as = tenant(opts.tenant)
    except InputError as exc:
        raise InputError(f"contextkit.tenant: {exc}", "contextkit") from None
    # the KV path (serve) reuses documents and skills as spans, and a conversation's earlier turns as an
    # exact prefix, unless told otherwise; a single-turn chat without them is a plain prefill
    turns = any(m.role in ("assistant", "tool") for m in messages)
    wants = opts.reuse is not None or (reuse_default and bool(docs or skills or turns))
    reuse = reuse_options(opts.reuse) if allow_reuse and wants else None
    request = ChatRequest(messages, docs, skills, runs_as, opts.ordering, opts.block_align, reuse,
                          chat.new_tokens or default_max_tokens, documents_at=opts.documents_at)
    return chat, request


# -- responses --------------------------------------------------------------------------------------


def error_body(status_or_exc: int | BaseException, message: str | None = None, param: str | None = None) -> dict:
    """An OpenAI error object for a status (or an exception, whose status ``http_status`` decides)."""
    if isinstance(status_or_exc, BaseException):
        exc = status_or_exc
        status, message = http_status(exc), message or str(exc)
        param = param or getattr(exc, "param", None)
    else:
        status = status_or_exc
    kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
            502: "upstream_error", 503: "service_unavailable", 504: "timeout"}.get(status, "api_error")  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_headers(exc: BaseException) -> dict[str, str]:
    """The headers an error answer carries beside its body: ``WWW-Authenticate`` on a 401 (RFC 9110 asks
    for it; OpenAI clients key on the status) and ``Retry-After`` on a 429."""
    if isinstance(exc, AuthenticationError):
        return {"www-authenticate": 'Bearer realm="contextkit"'}
    if isinstance(exc, OverloadedError):
        return {"retry-after": str(max(1, round(exc.retry_after_s)))}
    return {}


class _Out(BaseModel):
    # responses carry vLLM's extra fields (prompt_token_ids) where it sends them
    model_config = ConfigDict(extra="allow")


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None


class AssistantMessage(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Out):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None


class TextChoice(_Out):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class ChunkChoice(_Out):
    index: int = 0
    delta: dict[str, str]
    finish_reason: str | None = None
    logprobs: None = None


class Completion(_Out):
    """A ``chat.completion``, ``chat.completion.chunk`` or ``text_completion`` object, with our
    ``contextkit`` extension field when there is one."""

    id: str
    object: Literal["chat.completion", "chat.completion.chunk", "text_completion"]
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str | None = None
    choices: list[ChatChoice | TextChoice | ChunkChoice]
    usage: dict[str, Any] | None = None  # ours (``usage()``) or the upstream's, as it sent it
    contextkit: dict[str, Any] | None = None

    def dump(self) -> dict:
        out = self.model_dump(mode="json")
        for optional in ("usage", "contextkit"):
            if out[optional] is None:
                del out[optional]
        return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details={"cached_tokens": cached_tokens}).model_dump()


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _created(created: int | None) -> dict:
    return {} if created is None else {"created": created}


def completion(rid: str, model: str | None, chat: bool, choices: list[tuple[int, str, str | None, dict]],
               use: dict | None, extension: dict | None = None, created: int | None = None) -> dict:
    """A whole ``chat.completion`` (or ``text_completion``) response; ``choices`` = (index, text, finish
    reason, extra fields of the choice)."""
    if chat:
        out = [ChatChoice(index=i, message=AssistantMessage(content=text), finish_reason=f, **extra)
               for i, text, f, extra in choices]
    else:
        out = [TextChoice(index=i, text=text, finish_reason=f, **extra) for i, text, f, extra in choices]
    return Completion(id=rid, object="chat.completion" if chat else "text_completion", model=model, choices=out,
                      usage=use, contextkit=extension, **_created(created)).dump()


def chunk(rid: str, model: str | None, chat: bool, deltas: list[tuple[int, str, bool, str | None]],
          created: int | None = None, use: dict | None = None, extension: dict | None = None) -> dict:
    """One streamed chunk; ``deltas`` = (choice index, text, first delta of that choice, finish reason)."""
    choices: list = []
    for i, text, first, finish in deltas:
        if chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not finish else {})
            choices.append(ChunkChoice(index=i, delta=delta, finish_reason=finish))
        else:
            choices.append(TextChoice(index=i, text=text, finish_reason=finish))
    return Completion(id=rid, object="chat.completion.chunk" if chat else "text_completion", model=model,
                      choices=choices, usage=use, contextkit=extension, **_created(created)).dump()


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"
