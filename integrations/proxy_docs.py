"""Documents in a chat request: validate, render to stable token segments, translate the answer back.

A chat request may carry ``documents`` (vLLM's field: a list of ``{"title", "text"}``, optionally
``"id"``) and ``contextkit`` options (``ordering``: ``weaver`` | ``retrieval``, ``tenant``,
``block_align``). The fixed template: the chat template of the model, with the documents placed at the
start of the last user message, each as ``Document: <title>\\n<text>\\n\\n`` (``contextkit.prompt``) and
tokenized on its own so a document's tokens are the same in every request. The request is sent to the
upstream's ``/v1/completions`` as token ids (so the segments stay as tokenized, which is what lets the
prefix cache hit) and the completion is translated back into a chat completion, streamed or not.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from contextkit.ordering.align import align
from contextkit.prompt import DEFAULT_SYSTEM, render_document, render_frame
from contextkit.tokenizer import Tokenizer
from contextkit.types import Evidence

OPTIONS = {"ordering", "tenant", "block_align"}
ORDERINGS = ("weaver", "retrieval")
# chat fields forwarded to /v1/completions as they are; anything else in a documents request is refused
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "stream", "stream_options", "user", "logit_bias")
ACCEPTED = {"model", "messages", "documents", "contextkit", "max_completion_tokens", *SAMPLING}


class RequestError(ValueError):
    """A client error with its HTTP status and the field to fix."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass(frozen=True, slots=True)
class DocRequest:
    messages: list[dict]
    documents: list[Evidence]
    ordering: str
    tenant: str
    block_align: bool


def json_body(raw: bytes) -> dict:
    """A request body as a JSON object, or a ``RequestError`` (400 not a JSON object)."""
    try:
        body = json.loads(raw or b"null")
    except json.JSONDecodeError as exc:
        raise RequestError(400, f"request body is not valid JSON ({exc.msg} at position {exc.pos})") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def parse(body: dict, options: set[str] = OPTIONS) -> DocRequest:
    """Check a documents request; every problem is a ``RequestError`` saying what to fix."""
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise RequestError(422, f"unknown fields {unknown} in a documents request; accepted: {sorted(ACCEPTED)}", unknown[0])
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
        raise RequestError(422, "messages must be a non-empty list of {role, content} objects", "messages")
    if not any(m.get("role") == "user" and isinstance(m.get("content"), str) for m in msgs):
        raise RequestError(422, "messages need a user message with string content (the question)", "messages")
    docs = body.get("documents", [])
    if not isinstance(docs, list):
        raise RequestError(422, "documents must be a list of {title, text} objects", "documents")
    evidence, seen = [], set()
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or not isinstance(d.get("text"), str) or not d["text"].strip():
            raise RequestError(422, f"documents[{i}] must be an object with a non-empty string \"text\"", "documents")
        title = d.get("title")
        if title is not None and not isinstance(title, str):
            raise RequestError(422, f"documents[{i}].title must be a string", "documents")
        did = str(d.get("id") or hashlib.sha256(f"{title or ''}\x00{d['text']}".encode()).hexdigest()[:16])
        if did in seen:
            raise RequestError(422, f"documents[{i}] repeats id {did!r}; send each document once", "documents")
        seen.add(did)
        evidence.append(Evidence(text=d["text"], title=title, id=did))
    opts = body.get("contextkit") or {}
    if not isinstance(opts, dict) or set(opts) - options:
        raise RequestError(422, f"contextkit options must be an object with keys from {sorted(options)}", "contextkit")
    ordering = opts.get("ordering", "weaver")
    if ordering not in ORDERINGS:
        raise RequestError(422, f"contextkit.ordering must be one of {ORDERINGS}, got {ordering!r}", "contextkit")
    tenant = opts.get("tenant", "")
    if not isinstance(tenant, str) or len(tenant) > 128 or set("@/\\\x00") & set(tenant):
        raise RequestError(422, "contextkit.tenant must be a string of at most 128 characters without @ / \\ "
                                "(it is sent to vLLM as cache_salt)", "contextkit")
    return DocRequest(msgs, evidence, ordering, tenant, bool(opts.get("block_align", False)))


class Renderer:
    """Token segments of a request with documents: frame (the chat template before and after the
    documents, ``contextkit.prompt.render_frame``) and one separately tokenized block per document,
    optionally padded to the block size. Shared by the proxy and the benchmarks that send the same
    prompts straight to vLLM, so both sides send the very same tokens."""

    def __init__(self, tokenizer: Tokenizer, block_size: int):
        self.tok = tokenizer
        self.block_size = block_size
        self.pad_id = tokenizer.encode("\n")[-1]  # a blank line: the least intrusive filler we can send
        self._cache: dict[str, tuple[int, ...]] = {}
        self._frames: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def doc_ids(self, doc: Evidence) -> tuple[int, ...]:
        """The document's tokens, cached by content (a client may reuse an id for another text)."""
        key = hashlib.sha256(f"{doc.title or ''}\x00{doc.text}".encode()).hexdigest()
        ids = self._cache.get(key)
        if ids is None:
            ids = tuple(self.tok.encode(render_document(doc)))
            if len(self._cache) > 100_000:
                self._cache.clear()
            self._cache[key] = ids
        return ids

    def frame(self, messages: list[dict]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Prefix and suffix ids; without a system message the default one is used. Cached per
        conversation: the chat template and tokenizer run once for a repeated question."""
        key = json.dumps(messages, sort_keys=True)
        got = self._frames.get(key)
        if got is None:
            if not any(m.get("role") == "system" for m in messages):
                messages = [{"role": "system", "content": DEFAULT_SYSTEM}, *messages]
            head, tail = render_frame(self.tok, messages)
            got = (tuple(head), tuple(tail))  # shared by later requests: immutable
            if len(self._frames) > 10_000:
                self._frames.clear()
            self._frames[key] = got
        return got

    def ids(self, messages: list[dict], documents: Sequence[Evidence], order: Sequence[int],
            block_align: bool = False) -> tuple[list[int], int]:
        """The prompt with ``documents`` in ``order``, and the pad tokens it holds."""
        head, tail = self.frame(messages)
        docs = [self.doc_ids(documents[i]) for i in order]
        if block_align:
            a = align(head, docs, self.block_size, self.pad_id)
            return a.ids(tail), a.padding
        return [*head, *(t for d in docs for t in d), *tail], 0


def completion_body(body: dict, prompt: list[int], tenant: str) -> dict:
    out = {k: body[k] for k in SAMPLING if k in body}
    if "max_completion_tokens" in body and "max_tokens" not in body:
        out["max_tokens"] = body["max_completion_tokens"]
    out.update(model=body.get("model"), prompt=prompt)
    if out.get("stream"):
        out["stream_options"] = {**(out.get("stream_options") or {}), "include_usage": True}
    if tenant:
        out["cache_salt"] = tenant
    return out


def chat_from_completion(resp: dict, extension: dict) -> dict:
    """A ``text_completion`` response as a ``chat.completion`` one, with our extension field."""
    usage = resp.get("usage") or {}
    return {
        "id": "chatcmpl-" + str(resp.get("id", uuid.uuid4().hex)).removeprefix("cmpl-"),
        "object": "chat.completion",
        "created": resp.get("created", int(time.time())),
        "model": resp.get("model"),
        "choices": [{"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", "")},
                     "finish_reason": c.get("finish_reason"), "logprobs": None} for c in resp.get("choices", [])],
        "usage": usage,
        "contextkit": {**extension, "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")},
    }


def chat_chunk(obj: dict, first: set[int], extension: dict) -> dict:
    """One streamed completion chunk as a ``chat.completion.chunk``."""
    choices = []
    for c in obj.get("choices") or ():
        i = c.get("index", 0)
        delta = {"content": c.get("text", "")}
        if i not in first:
            first.add(i)
            delta = {"role": "assistant", **delta}
        choices.append({"index": i, "delta": delta, "finish_reason": c.get("finish_reason"), "logprobs": None})
    out = {"id": "chatcmpl-" + str(obj.get("id", "")).removeprefix("cmpl-"), "object": "chat.completion.chunk",
           "created": obj.get("created", int(time.time())), "model": obj.get("model"), "choices": choices}
    if obj.get("usage"):
        usage = obj["usage"]
        out["usage"] = usage
        out["contextkit"] = {**extension, "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    return out


def sse(obj: dict | str) -> bytes:
    return b"data: " + (obj if isinstance(obj, str) else json.dumps(obj)).encode() + b"\n\n"
