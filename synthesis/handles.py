"""Kept answers: a worker's KV kept under a handle, for a synthesizer that arrives later over HTTP.

The HTTP shape (docs/servers.md, "Parallel agents over HTTP"): a worker is an ordinary chat completion
with ``contextkit: {"keep": true}``; its KV (the answer's tokens, with what it read before them) is kept
under its response id, the handle. A synthesizer is an ordinary chat completion that carries the workers'
answers as text (in ``documents`` or in its messages, wherever a framework puts them) and names their
handles (``contextkit.handles``, or ``documents[].handle``). For each named handle the server looks for the
kept answer's tokens in the synthesizer's prompt; where they are, that stretch of the prompt becomes a
reused span whose KV is the kept one (re-positioned and partly recomputed by the request's policy, as the
in-process ``join``), the rest of the prompt is computed as usual. Where they are not (the handle is
unknown, expired, evicted or another tenant's, or the text was edited), the text is prefilled: a miss
costs speed, never the answer, and the report says which handles were read from KV and why the others
were not. A kept answer is request-only KV: it is never put in the span store, and another tenant's
handle is the same miss as an unknown one.

``KeptSpans`` holds them, per tenant, bounded in count and bytes per key tenant and in all, with a TTL.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.plan import RequestPlan
from contextkit.core.tenant import Tenant
from contextkit.core.types import HANDLE, is_handle
from contextkit.spans.key import span_key
from contextkit.spans.store import CompiledSpan

Read = Literal["kv", "unknown", "expired", "mismatch", "malformed", "repeated", "not_reused"]
"""How a named handle was read: ``kv`` (its kept KV, re-positioned); else from the text, because it is
``unknown`` (never kept, evicted, or another tenant's: one answer for all three), ``expired`` (past the
TTL), ``mismatch`` (its answer's tokens are not in the prompt: the text was edited or tokenizes otherwise),
``malformed`` (not a handle), ``repeated`` (named twice), or ``not_reused`` (the request prefills in full)."""


@dataclass(frozen=True, slots=True)
class KeepLimits:
    """What kept answers may hold.

    Attributes:
        ttl_s: a kept answer is dropped this long after it was kept.
        max_handles: kept answers per key tenant (its sub-tenants' included); the oldest goes first.
        max_bytes: their KV bytes per key tenant.
        max_total_bytes: their KV bytes in all (the least recently kept go first, whoever kept them).
        max_per_request: handles one request may name (more: 422 naming the limit).
    """

    ttl_s: float = 600.0
    max_handles: int = 256
    max_bytes: int = 256 << 20
    max_total_bytes: int = 1 << 30
    max_per_request: int = 32

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or min(self.max_handles, self.max_bytes, self.max_total_bytes, self.max_per_request) < 1:
            raise ConfigError("keep limits must be positive")


@dataclass(frozen=True, slots=True)
class Kept:
    """One kept answer: its KV (position-free), the text it decodes to, when it expires, and the KV of the
    documents its worker read, as the worker computed them (position-free too; a synthesizer that reads
    the workers' transcripts finds them as whole documents of its prompt)."""

    span: CompiledSpan
    text: str
    expires: float
    read: tuple[CompiledSpan, ...] = ()

    @property
    def nbytes(self) -> int:
        return self.span.nbytes + sum(r.nbytes for r in self.read)


@dataclass(frozen=True, slots=True)
class HandleRead:
    """What a request did with one named handle (reported in the response's ``contextkit.handles``)."""

    handle: str
    read: Read
    tokens: int = 0  # the kept answer's tokens read from KV
    read_tokens: int = 0  # tokens of documents its worker read, read from the worker's KV

    def as_dict(self) -> dict[str, Any]:
        return {"handle": self.handle, "read": self.read, "tokens": self.tokens, "read_tokens": self.read_tokens}


class KeptSpans:
    """Kept answers by (tenant, handle), bounded by ``KeepLimits`` (see the module docstring).

    ``clock`` is the monotonic clock the TTL is measured on (a test passes its own). Thread-safe (serve
    keeps and reads on its engine thread, and drops on its event loop)."""

    def __init__(self, limits: KeepLimits = KeepLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits, self._clock = limits, clock
        self._entries: OrderedDict[tuple[str, str], Kept] = OrderedDict()  # oldest first
        self._count: dict[str, int] = {}  # per key tenant
        self._bytes: dict[str, int] = {}
        self.total_bytes = 0
        self.evicted = 0
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        """Kept answers, their KV bytes, and how many the limits evicted so far."""
        with self._lock:
            return {"handles": len(self._entries), "bytes": self.total_bytes, "evicted": self.evicted}

    def recent(self, tenant: Tenant, n: int) -> list[str]:
        """``tenant``'s ``n`` most recently kept handles that have not expired, newest first."""
        now = self._clock()
        with self._lock:
            mine = [h for (t, h), e in reversed(self._entries.items()) if t == tenant.name and e.expires > now]
        return mine[:n]

    def put(self, tenant: Tenant, handle: str, span: CompiledSpan, text: str,
            read: Sequence[CompiledSpan] = ()) -> bool:
        """Keep ``span`` (and what its worker read) under ``handle`` for ``tenant``; False if it alone is
        over the byte limits."""
        if not HANDLE.fullmatch(handle):
            raise InputError(f"a handle is 1-128 letters, digits or '_.:-', got {handle[:40]!r}", "handle")
        kept = Kept(span, text, self._clock() + self.limits.ttl_s, tuple(read))
        if kept.nbytes > min(self.limits.max_bytes, self.limits.max_total_bytes):
            return False
        with self._lock:
            self._put(tenant, handle, kept, kept.nbytes)
        return True

    def _put(self, tenant: Tenant, handle: str, kept: Kept, size: int) -> None:
        self.drop(tenant, handle)
        self._expire()
        owner = tenant.key_tenant.name
        while (self._count.get(owner, 0) >= self.limits.max_handles
               or self._bytes.get(owner, 0) + size > self.limits.max_bytes):
            self._evict(next(k for k in self._entries if _owner(k) == owner))
        while self.total_bytes + size > self.limits.max_total_bytes:
            self._evict(next(iter(self._entries)))
        self._entries[(tenant.name, handle)] = kept
        self._count[owner] = self._count.get(owner, 0) + 1
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        self.total_bytes += size

    def get(self, tenant: Tenant, handle: Any) -> tuple[Kept | None, Read]:
        """The kept answer ``tenant`` named ``handle`` (None and why not)."""
        if not is_handle(handle):
            return None, "malformed"
        key = (tenant.name, handle)
        with self._lock:
            kept = self._entries.get(key)
            if kept is None:
                return None, "unknown"
            if kept.expires <= self._clock():
                self._remove(key)
                return None, "expired"
            return kept, "kv"

    def drop(self, tenant: Tenant, handle: str) -> bool:
        """Forget ``tenant``'s ``handle`` (True if it was kept)."""
        key = (tenant.name, handle)
        with self._lock:
            if key not in self._entries:
                return False
            self._remove(key)
            return True

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self._remove(key)

    def _evict(self, key: tuple[str, str]) -> None:
        self._remove(key)
        self.evicted += 1

    def _remove(self, key: tuple[str, str]) -> None:
        kept = self._entries.pop(key)
        owner = _owner(key)
        self._count[owner] -= 1
        self._bytes[owner] -= kept.nbytes
        self.total_bytes -= kept.nbytes
        if not self._count[owner]:
            del self._count[owner], self._bytes[owner]


def _owner(key: tuple[str, str]) -> str:
    return Tenant(key[0]).key_tenant.name


def keep_answer(spans, stream, plan: RequestPlan,
                tenant: Tenant) -> tuple[CompiledSpan, str, tuple[CompiledSpan, ...]] | str:
    """A finished generation's answer as a position-free span, its text, and the KV of the documents the
    worker read (each as the worker computed it, position-free), or why it cannot be kept.

    ``stream`` is the ``engine.generate.Stream`` that generated it: its cache holds the prompt, then one
    slot per generated token that was fed back; the last token's KV is computed here when the stream
    stopped before feeding it (one decode step). Whitespace-only tokens at either end are left out (a
    framework may strip them; the prompt renders documents stripped). The documents are kept only where
    the prompt lies in the cache in order, one slot per token (no separators or padding between spans)."""
    from contextkit.synthesis.parallel import generated_span

    gen = stream.result
    ids = list(gen.token_ids) if gen is not None else []
    if not ids:
        return "nothing was generated"
    cache, start = stream.cache, stream.prompt_slots
    fed = cache.length - start
    if fed < len(ids):  # stopped by length or a stop string: the last token was never fed back
        spans.engine.forward(cache, ids[fed:], logits="none")
    tok = stream.tokenizer
    solid = [i for i, t in enumerate(ids) if tok.decode([t]).strip()]
    if not solid:
        return "the answer is only whitespace"
    a, b = solid[0], solid[-1] + 1
    text = tok.decode(ids[a:b])
    if text.strip() != gen.text.strip():
        return "a stop string cut the answer inside a token"
    prompt = tuple(plan.ids)
    context = span_key(spans.identity, prompt, (), tenant)
    span = generated_span(spans, cache, range(start + a, start + b), tuple(ids[a:b]), context, tenant)
    read: list[CompiledSpan] = []
    if start == len(prompt) and bool((cache.positions[:start] == torch.arange(start)).all()):
        at = 0
        for it in plan.items:
            n = len(it.span.token_ids)
            if it.span.kind == "document":
                seen = span_key(spans.identity, prompt[:at], (), tenant)
                read.append(generated_span(spans, cache, range(at, at + n), it.span.token_ids, seen, tenant))
            at += n
    return span, text, tuple(read)
