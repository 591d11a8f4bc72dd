"""The SDK's request and result shapes, and the transport seam every client method goes through.

One ``Client`` (``contextkit.sdk.session``) runs on either transport with the same methods and the same
results: in-process on the built-in engine (``contextkit.sdk.local.LocalTransport``) or over HTTP to a
``contextkit serve`` or ``contextkit proxy`` URL (``contextkit.sdk.http``). The
framework adapters (``contextkit.integrations.frameworks.langchain`` / ``.llamaindex``) are written against these
types, so they work on both.

Names follow OpenAI and vLLM (``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``); where ours
differ: ``temperature`` defaults to 0 (greedy, deterministic) where OpenAI's default is 1, and the built-in
engine's ``SamplingParams.max_new_tokens`` is ``max_tokens`` here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from contextkit.core.errors import ConfigError
from contextkit.core.plan import ReuseReport
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import Evidence, Message, Skill

ReusePath = Literal["kv", "prompt", "prefill"]


@dataclass(frozen=True, slots=True)
class Call:
    """One generation request as a transport receives it (the client builds it from its arguments).

    ``reuse``: None = the transport's default (span reuse at the default policy wherever there are
    documents or skills on the KV path; the proxy orders for vLLM's prefix cache), a ``ReuseOptions`` to
    choose the policy, or ``False`` for a full prefill (KV path only; the proxy always sends a prompt).
    """

    messages: tuple[Message, ...]
    documents: tuple[Evidence, ...] = ()
    skills: tuple[Skill, ...] = ()
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    reuse: ReuseOptions | Literal[False] | None = None
    ordering: Literal["weaver", "retrieval"] = "weaver"
    tenant: str | None = None
    documents_at: Literal["last", "first"] = "last"
    keep: bool = False  # over HTTP to serve: keep the answer's KV under its id (a worker; ``fork``)
    # over HTTP to serve: kept answers this call carries as text (``join``), or "auto" (the tenant's recent ones)
    handles: tuple[str, ...] | Literal["auto"] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True, slots=True)
class ReuseSummary:
    """What the request reused, on any transport, in tokens.

    ``path``: ``kv`` (span KV re-positioned and spliced: the built-in engine, ``contextkit serve``),
    ``prompt`` (ordered for vLLM's prefix cache: the proxy) or ``prefill`` (nothing reusable asked for).
    ``cached_tokens``: KV that existed before this request (span hits; vLLM's prefix-cache hits).
    ``reused_tokens``: prompt tokens served from cached KV without recompute; ``recomputed_tokens``: reused
    span tokens computed again in the new context; ``prefilled_tokens``: tokens computed with no reusable KV;
    ``compiled_tokens``: span tokens compiled (and stored) during this request. ``skipped_documents``:
    documents a session did not send again because its context already holds them.
    ``handles``: (handle, how it was read) for each kept answer the call named (``kv``, or why its text
    was used: ``synthesis.handles.Read``); ``kept``: the handle this answer was kept under (``keep``).
    ``detail``: the built-in engine's full report (timings and all), in process only.
    """

    path: ReusePath
    prompt_tokens: int
    cached_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    prefilled_tokens: int = 0
    compiled_tokens: int = 0
    order: tuple[str, ...] = ()
    reordered: bool = False
    policy: str | None = None
    skipped_documents: tuple[str, ...] = ()
    handles: tuple[tuple[str, str], ...] = ()
    kept: str | None = None
    detail: ReuseReport | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict:
        """JSON-ready (frameworks put it in their response metadata)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "detail"}
        out["order"], out["skipped_documents"] = list(self.order), list(self.skipped_documents)
        out["handles"] = [list(h) for h in self.handles]
        return out


@dataclass(frozen=True, slots=True)
class Answer:
    """A finished generation. ``ttft_ms``: from the call to the first token, as the client saw it (HTTP
    included); ``total_ms``: to the last. ``report`` says what was reused."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    report: ReuseSummary
    ttft_ms: float
    total_ms: float
    model: str | None = None
    id: str | None = None


class Transport(Protocol):
    """Where a ``Client`` sends its calls. ``stream`` yields text deltas, then the ``Answer`` last."""

    name: str
    skills: Any  # a SkillLibrary: register(folder), get(name), retrieve(task)

    def complete(self, call: Call) -> Answer: ...

    def stream(self, call: Call) -> Iterator[str | Answer]: ...

    async def acomplete(self, call: Call) -> Answer: ...

    def astream(self, call: Call) -> AsyncIterator[str | Answer]: ...

    def skill(self, name: str) -> Skill: ...

    def close(self) -> None: ...
