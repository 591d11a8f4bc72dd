"""The SDK's HTTP transport: a ``contextkit serve`` or ``contextkit proxy`` URL, with an API key.

A call is one ``/v1/chat/completions`` request in the shape both servers take (``documents``, ``skills``
and our ``contextkit`` options beside OpenAI's fields); the answer's ``report`` comes from the response's
``contextkit`` field (serve: span reuse, the KV path; the proxy: ordering for vLLM's prefix cache, with
vLLM's own ``cached_tokens``). Errors come back as the error tree's exceptions with the server's message:
the class the error object's ``contextkit_code`` names (the table in ``contextkit.core.errors``), or for
an error without one (vLLM's own) the status's: 401 ``AuthenticationError``, 403 ``PermissionDeniedError``,
413 ``BodyTooLargeError``, other 4xx ``InputError``, 429 ``OverloadedError`` (with ``retry_after_s``), 504
``UpstreamTimeoutError``, other 5xx ``UpstreamError``. An unreachable server is ``UpstreamError`` (a timeout
``UpstreamTimeoutError``): never a hang past ``timeout_s``.

httpx, not the openai package: the openai client retries on its own and hides our response field in
``model_extra``; the drop-in path (``ChatOpenAI`` / ``OpenAILike`` at the proxy) is tested separately.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx

from contextkit.core.errors import (
    AuthenticationError,
    BodyTooLargeError,
    ContextKitError,
    InputError,
    OverloadedError,
    PermissionDeniedError,
    UpstreamError,
    UpstreamTimeoutError,
    error_class,
)  # fmt: skip
from contextkit.core.types import Skill
from contextkit.sdk.shapes import Answer, Call, ReuseSummary
from contextkit.synthesis.skills import SkillLibrary


def body_of(call: Call, model: str | None, stream: bool) -> dict:
    """The chat-completions body for ``call``."""
    body: dict[str, Any] = {
        "messages": [{"role": m.role, "content": m.content} for m in call.messages],
        "max_tokens": call.max_tokens, "temperature": call.temperature, "top_p": call.top_p,
    }  # fmt: skip
    if model:
        body["model"] = model
    if call.stop:
        body["stop"] = list(call.stop)
    if call.seed is not None:
        body["seed"] = call.seed
    if call.documents:
        body["documents"] = [{k: v for k, v in (("text", d.text), ("title", d.title), ("id", d.id)) if v is not None}
                             for d in call.documents]
    if call.skills:
        body["skills"] = [{"name": s.name, "text": s.text} for s in call.skills]
    opts: dict[str, Any] = {}
    if call.ordering != "weaver":
        opts["ordering"] = call.ordering
    if call.tenant is not None:
        opts["tenant"] = call.tenant
    if call.documents_at != "last" and call.documents:
        opts["documents_at"] = call.documents_at
    if call.keep:
        opts["keep"] = True
    if call.handles:
        opts["handles"] = call.handles if isinstance(call.handles, str) else list(call.handles)
    if call.reuse is False:
        opts["reuse"] = {"policy": "full"}
    elif call.reuse is not None:
        opts["reuse"] = {f.name: getattr(call.reuse, f.name) for f in dataclasses.fields(call.reuse)}
    if opts:
        body["contextkit"] = opts
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def summary(usage: dict | None, ext: dict | None) -> ReuseSummary:
    """The reuse report from a response's ``usage`` and ``contextkit`` fields."""
    usage, ext = usage or {}, ext or {}
    prompt = int(usage.get("prompt_tokens") or ext.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    order, reordered = tuple(str(x) for x in ext.get("order") or ()), bool(ext.get("reordered"))
    handles = tuple((str(h.get("handle")), str(h.get("read"))) for h in ext.get("handles") or ())
    kept = (ext.get("kept") or {}).get("handle")
    if "reused_tokens" in ext:  # serve: the KV path
        return ReuseSummary("kv", prompt, int(ext.get("cached_tokens") or 0), int(ext["reused_tokens"]),
                            int(ext.get("recomputed_tokens") or 0), int(ext.get("prefilled_tokens") or 0),
                            int(ext.get("compiled_tokens") or 0), order, reordered, ext.get("policy"),
                            handles=handles, kept=kept)
    # the proxy (or a plain chat vLLM answered from its cache); serve's plain prefill says only what it kept
    path = "prompt" if set(ext) - {"kept", "handles"} or cached else "prefill"
    return ReuseSummary(path, prompt, cached, cached, 0, prompt - cached, 0, order, reordered, handles=handles,
                        kept=kept)


# the class for an error object without ``contextkit_code`` (vLLM's own, or a server in between), by status
_BY_STATUS: dict[int, type[ContextKitError]] = {401: AuthenticationError, 403: PermissionDeniedError,
                                                413: BodyTooLargeError, 429: OverloadedError, 504: UpstreamTimeoutError}


def error_of(status: int, raw: bytes | str, url: str, headers: httpx.Headers | None = None) -> ContextKitError:
    """An error answer as the exception the error tree has for it: the class its ``contextkit_code`` names
    (``contextkit.core.errors.ERRORS``), else the one its status says (other 4xx ``InputError``, other 5xx
    ``UpstreamError``)."""
    try:
        err = json.loads(raw)["error"]
        message, param, code = str(err.get("message")), err.get("param"), err.get("contextkit_code")
    except (ValueError, KeyError, TypeError, AttributeError):
        message, param, code = (raw.decode(errors="replace") if isinstance(raw, bytes) else raw)[:300], None, None
    where = f"{url} answered {status}: {message}"
    cls = error_class(code) or _BY_STATUS.get(status) or (InputError if 400 <= status < 500 else UpstreamError)
    if issubclass(cls, AuthenticationError):
        return cls(where + " (pass api_key=, the key the server was started with)")
    if issubclass(cls, OverloadedError):
        try:
            retry = float((headers or {}).get("retry-after") or 1)
        except ValueError:
            retry = 1.0
        return cls(where, retry_after_s=retry)
    if issubclass(cls, InputError):
        return cls(where, param)
    return cls(where)


class HTTPTransport:
    """``Client`` calls as HTTP requests to ``url`` (a serve or proxy root, e.g. ``http://localhost:8000``).

    Args:
        url: the server's root URL (``/v1`` is added).
        api_key: sent as ``Authorization: Bearer``; None for a server started without keys.
        model: the model name to send; None asks the server's ``/v1/models`` once and uses the first.
        timeout_s: the longest wait for any one read (and 5 s to connect).
    """

    name = "http"

    def __init__(self, url: str, api_key: str | None = None, model: str | None = None, timeout_s: float = 120.0):
        if not url.startswith(("http://", "https://")):
            raise InputError(f"url must start with http:// or https://, got {url!r}", "url")
        self.url = url.rstrip("/").removesuffix("/v1")
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self._model = model
        self._http = httpx.Client(timeout=self.timeout, headers=self.headers)
        # skills go to the server as text (the prompt path): a client-side library holds them
        self.skills = SkillLibrary(None)  # type: ignore[arg-type]

    def skill(self, name: str) -> Skill:
        return self.skills.get(name)

    # -- sync ---------------------------------------------------------------------------------------

    def model(self) -> str | None:
        if self._model is None:
            try:
                resp = self._http.get(self.url + "/v1/models")
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from exc
            self._model = self._first_model(resp)
        return self._model or None

    def _first_model(self, resp: httpx.Response) -> str:
        """The first id a ``/v1/models`` answer lists ("" for none: the server picks)."""
        if resp.status_code != 200:
            raise error_of(resp.status_code, resp.content, self.url, resp.headers)
        data = resp.json().get("data") or []
        return data[0]["id"] if data else ""

    def complete(self, call: Call) -> Answer:
        body = body_of(call, self.model(), stream=False)
        t0 = time.perf_counter()
        try:
            resp = self._http.post(self.url + "/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        return self._answer(resp, (time.perf_counter() - t0) * 1e3)

    def stream(self, call: Call) -> Iterator[str | Answer]:
        body = body_of(call, self.model(), stream=True)
        state = _StreamState(time.perf_counter())
        try:
            with self._http.stream("POST", self.url + "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    raise error_of(resp.status_code, resp.read(), self.url, resp.headers)
                yield from state.deltas(resp.iter_lines(), self.url)
        except httpx.HTTPError as exc:
            raise self._unreachable(exc) from exc
        yield state.answer()

    # -- async --------------------------------------------------------------------------------------

    async def _amodel(self, client: httpx.AsyncClient) -> str | None:
        if self._model is None:
            self._model = self._first_model(await client.get(self.url + "/v1/models"))
        return self._model or None

    async def acomplete(self, call: Call) -> Answer:
        # one AsyncClient per call: an httpx.AsyncClient belongs to the event loop it was made on, and
        # callers run several loops (asyncio.run per call in scripts, frameworks' own loops)
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            try:
                body = body_of(call, await self._amodel(client), stream=False)
                t0 = time.perf_counter()
                resp = await client.post(self.url + "/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from exc
            return self._answer(resp, (time.perf_counter() - t0) * 1e3)

    async def astream(self, call: Call) -> AsyncIterator[str | Answer]:
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as client:
            try:
                body = body_of(call, await self._amodel(client), stream=True)
                state = _StreamState(time.perf_counter())
                async with client.stream("POST", self.url + "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise error_of(resp.status_code, await resp.aread(), self.url, resp.headers)
                    async for line in resp.aiter_lines():  # state.deltas' loop: async has no yield from
                        if delta := state.feed(line, self.url):
                            yield delta
            except httpx.HTTPError as exc:
                raise self._unreachable(exc) from exc
        yield state.answer()

    # -- shared -------------------------------------------------------------------------------------

    def _unreachable(self, exc: httpx.HTTPError) -> UpstreamError:
        if isinstance(exc, httpx.TimeoutException):
            return UpstreamTimeoutError(f"{self.url} did not answer within the timeout ({type(exc).__name__})")
        return UpstreamError(f"cannot reach {self.url} ({type(exc).__name__}: {exc}); is the server running "
                             "(contextkit serve / contextkit proxy) and the URL right?")

    def _answer(self, resp: httpx.Response, ms: float) -> Answer:
        """A non-streamed answer (or the error it is), ``ms`` after the request was sent."""
        if resp.status_code != 200:
            raise error_of(resp.status_code, resp.content, self.url, resp.headers)
        obj = resp.json()
        choice = (obj.get("choices") or [{}])[0]
        usage = obj.get("usage") or {}
        return Answer(
            (choice.get("message") or {}).get("content") or "", choice.get("finish_reason"),
            int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
            summary(usage, obj.get("contextkit")), ms, ms, obj.get("model"), obj.get("id"),
        )  # fmt: skip

    def fork(self, client, prefix: str, prompts, documents=(), max_tokens: int = 64, tenant: str | None = None):
        """Workers as chats that keep their KV, joined by a chat that names them (``contextkit.sdk.team``;
        the server must be ``contextkit serve``: the proxy answers a join from the text)."""
        from contextkit.sdk.team import fork

        return fork(client, prefix, prompts, documents, max_tokens, tenant)

    def close(self) -> None:
        self._http.close()


class _StreamState:
    """What a server-sent-events stream has said so far."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.first_ms: float | None = None
        self.parts: list[str] = []
        self.finish: str | None = None
        self.usage: dict = {}
        self.ext: dict | None = None
        self.model = self.id = None

    def feed(self, line: str, url: str) -> str:
        if not line.startswith("data:"):
            return ""
        data = line[5:].strip()
        if data == "[DONE]":
            return ""
        obj = json.loads(data)
        if "error" in obj:  # the server failed after the stream began
            status = (obj["error"] or {}).get("code") if isinstance(obj["error"], dict) else None
            raise error_of(status if isinstance(status, int) else 500, json.dumps(obj), url)
        self.model, self.id = obj.get("model", self.model), obj.get("id", self.id)
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("contextkit"):
            self.ext = obj["contextkit"]
        text = ""
        for c in obj.get("choices") or ():
            text += (c.get("delta") or {}).get("content") or ""
            self.finish = c.get("finish_reason") or self.finish
        if text:
            if self.first_ms is None:
                self.first_ms = (time.perf_counter() - self.t0) * 1e3
            self.parts.append(text)
        return text

    def deltas(self, lines: Iterable[str], url: str) -> Iterator[str]:
        """The text deltas of ``lines`` (a response's), fed in order."""
        for line in lines:
            if delta := self.feed(line, url):
                yield delta

    def answer(self) -> Answer:
        total = (time.perf_counter() - self.t0) * 1e3
        return Answer("".join(self.parts), self.finish, int(self.usage.get("prompt_tokens") or 0),
                      int(self.usage.get("completion_tokens") or 0),
                      summary(self.usage, self.ext),
                      total if self.first_ms is None else self.first_ms, total, self.model, self.id)
