"""The OpenAI API shapes both servers share (pydantic models): what a request may carry and what an
answer holds.

Requests: a chat completion may carry ``documents`` (vLLM's field: ``{"title", "text"}``, optionally
``"id"``) and ``contextkit`` options (``ordering``: ``weaver`` | ``retrieval``, ``tenant``,
``block_align``; on serve also ``reuse``: the fields of ``ReuseOptions``). Responses: chat completions,
chunks and text completions, with our ``contextkit`` extension field. Reading and checking a body is
``parse.py``; building an answer, an error or an event is ``answers.py``.
"""


from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, field_validator

from contextkit.core.errors import ConfigError, InputError  # fmt: skip
from contextkit.core.generation import SamplingParams
from contextkit.core.policy import POLICIES
from contextkit.core.types import ROLES

# chat fields a documents request may carry and the proxy forwards to /v1/completions as they are
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "stream", "stream_options", "user", "logit_bias")


def check_utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (not valid UTF-8)") from None
    return value


Text = Annotated[str, AfterValidator(check_utf8)]  # every string that reaches the tokenizer
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
                parts.append(check_utf8(p["text"]))
            except ValueError as exc:
                raise InputError(f"messages: a content part {exc}", "messages") from None
        return "".join(parts)


class DocumentIn(_Strict):
    text: Text = Field(min_length=1)
    title: Text | None = None
    id: Annotated[str, Field(max_length=256)] | int | None = None
    # a kept worker answer this document's text is (serve, synthesis.handles): any JSON value is taken, a
    # malformed one is reported and the text used (a handle never makes a request fail)
    handle: Any = None

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
    fidelity_budget: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    attention_budget: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
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
    # parallel agents over HTTP (serve; synthesis.handles): keep this answer's KV under the response id,
    # and the handles of kept answers this request carries as text (any JSON values; the count is capped
    # by the server's limit, a 422 past it), or "auto": the tenant's recent kept answers, found by text
    keep: StrictBool = False
    handles: list[Any] | Literal["auto"] | None = Field(None, max_length=4096)


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
    # OpenAI's name for a conversation's cache key: the proxy keeps a session on one upstream by it
    # (integrations/proxy/routing.py, session affinity); serve has one engine and ignores it
    prompt_cache_key: Annotated[str, Field(max_length=256)] | None = None

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


