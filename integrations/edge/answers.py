"""Building answers: OpenAI completions and chunks with our ``contextkit`` field, server-sent events, and
OpenAI error objects (status, type and code from ``contextkit.core.errors.ERRORS``) with their headers.
"""

from __future__ import annotations

import json
import uuid

from contextkit.core.errors import AuthenticationError, OverloadedError, error_kind  # fmt: skip
from contextkit.integrations.edge.shapes import AssistantMessage, ChatChoice, ChunkChoice, Completion, TextChoice, Usage

# OpenAI's error ``type`` for an answer that is a status alone (a route's 404), not one of our exceptions
_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
                   422: "invalid_request_error", 429: "rate_limit_error", 502: "upstream_error",
                   503: "service_unavailable", 504: "timeout"}  # fmt: skip


def error_body(status_or_exc: int | BaseException, message: str | None = None, param: str | None = None) -> dict:
    """An OpenAI error object for an exception (its row of ``contextkit.core.errors.ERRORS``) or a status.

    ``code`` stays the numeric HTTP status, as it always was here: clients and our tests read it, the
    OpenAPI schema says integer, and vLLM's own error objects (which the proxy relays) carry the status
    there too. The class's stable string code goes beside it in ``contextkit_code`` (None for an answer
    that is a status alone), which the SDK maps back to the class.
    """
    if isinstance(status_or_exc, BaseException):
        exc = status_or_exc
        kind = error_kind(exc)
        status, kind_type, code = kind.status, kind.type, kind.code
        message, param = message or str(exc), param or getattr(exc, "param", None)
    else:
        status, kind_type, code = status_or_exc, _TYPE_OF_STATUS.get(status_or_exc, "api_error"), None
    return {"error": {"message": message, "type": kind_type, "param": param, "code": status, "contextkit_code": code}}


def error_headers(exc: BaseException) -> dict[str, str]:
    """The headers an error answer carries beside its body: ``WWW-Authenticate`` on a 401 (RFC 9110 asks
    for it; OpenAI clients key on the status) and ``Retry-After`` on a 429."""
    if isinstance(exc, AuthenticationError):
        return {"www-authenticate": 'Bearer realm="contextkit"'}
    if isinstance(exc, OverloadedError):
        return {"retry-after": str(max(1, round(exc.retry_after_s)))}
    return {}



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
