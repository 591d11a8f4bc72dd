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

import dataclasses
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.plan import PlanItem, RequestPlan
from contextkit.core.tenant import Tenant
from contextkit.core.types import Span
from contextkit.spans.key import span_key, token_digest
from contextkit.spans.store import CompiledSpan

HANDLE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # what our response ids look like (and a caller's own)

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
        if not isinstance(handle, str) or not HANDLE.fullmatch(handle):
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


TAIL_SLACK = 2  # answer tokens at the end that may be left to the text (they tokenize with what follows)
AUTO = "auto"  # ``contextkit.handles: "auto"``: the tenant's recent kept answers, wherever their text is


def splice(plan: RequestPlan, handles: Sequence[Any] | str, store: KeptSpans,
           tenant: Tenant) -> tuple[RequestPlan, dict[int, CompiledSpan], list[HandleRead]]:
    """``plan`` with each named handle's kept answer, where its tokens are in the prompt, made a reused
    span read from its KV: returns the new plan, the KV it is provided with (item index -> span) and what
    was done with each handle, in the order named.

    ``handles`` may be ``AUTO``: the tenant's ``max_per_request`` most recent kept answers are looked for
    (for a framework that passes results on as text and drops response ids); only those found are
    reported."""
    if isinstance(handles, str):
        if handles != AUTO:
            raise InputError(f"contextkit.handles is a list of handles or {AUTO!r}, got {handles[:40]!r}",
                             "contextkit")
        new, provided, reads = splice(plan, store.recent(tenant, store.limits.max_per_request), store, tenant)
        return new, provided, [r for r in reads if r.read in ("kv", "not_reused")]
    if len(handles) > store.limits.max_per_request:
        raise InputError(f"{len(handles)} handles named; at most {store.limits.max_per_request} per request "
                         "(send the rest as text only)", "contextkit")
    reads: list[HandleRead] = []
    found: dict[str, Kept] = {}
    for h in handles:
        name = h if isinstance(h, str) else repr(h)[:40]
        if name in found or any(r.handle == name for r in reads):
            reads.append(HandleRead(name, "repeated"))
            continue
        kept, why = store.get(tenant, h)
        if kept is None:
            reads.append(HandleRead(name, why))
        elif plan.options is None or plan.options.policy == "full":
            reads.append(HandleRead(name, "not_reused"))
        else:
            found[name] = kept
            reads.append(HandleRead(name, "kv"))
    items = list(plan.items)
    spans: dict[str, CompiledSpan] = {}
    for name, kept in found.items():
        ids = kept.span.token_ids
        # the answer's last tokens may tokenize otherwise before what follows it in the prompt (Qwen's
        # pre-tokenizer joins "." and "\n\n"): up to TAIL_SLACK of them are left to be computed in context
        for m in range(len(ids), max(len(ids) - TAIL_SLACK, 1) - 1, -1):
            at = _place(items, ids[:m])
            if at is not None:
                i, a = at
                items[i:i + 1] = _split(items[i], a, m, name)
                spans[name] = _head(kept.span, m)
                break
    provided = {j: spans[it.span.name.removeprefix("handle ")] for j, it in enumerate(items) if _is_kept(it)}
    read_tokens = _documents_read(items, found, spans, provided)
    reads = [r if r.read != "kv" else (dataclasses.replace(r, tokens=spans[r.handle].num_tokens,
                                                           read_tokens=read_tokens.get(r.handle, 0))
                                       if r.handle in spans else dataclasses.replace(r, read="mismatch"))
             for r in reads]
    return dataclasses.replace(plan, items=tuple(items)), provided, reads


def _place(items: list[PlanItem], needle: tuple[int, ...]) -> tuple[int, int] | None:
    """The first (item, offset) where ``needle`` lies inside one item that is not already a kept answer."""
    n = len(needle)
    for i, it in enumerate(items):
        if _is_kept(it):
            continue
        ids = it.span.token_ids
        # the answer may not end the prompt: the last item is the query, whose logits start the answer
        last = len(ids) - n - (i == len(items) - 1)
        a = 0
        while a <= last:
            try:
                a = ids.index(needle[0], a, last + 1)  # C speed: a prompt is scanned per named handle
            except ValueError:
                break
            if tuple(ids[a:a + n]) == needle:
                return i, a
            a += 1
    return None


def _documents_read(items: list[PlanItem], found: dict[str, Kept], placed: dict[str, CompiledSpan],
                    provided: dict[int, CompiledSpan]) -> dict[str, int]:
    """Documents of the prompt that a placed answer's worker read, provided with the worker's KV for them
    (whole documents, the same tokens); returns the tokens read so per handle."""
    out: dict[str, int] = {}
    for name in placed:
        for doc in found[name].read:
            j = next((j for j, it in enumerate(items) if j not in provided and it.reuse
                      and it.span.kind == "document" and it.span.token_ids == doc.token_ids), None)
            if j is not None:
                provided[j] = doc
                out[name] = out.get(name, 0) + doc.num_tokens
    return out


def _head(span: CompiledSpan, m: int) -> CompiledSpan:
    """The first ``m`` tokens of a position-free span (still position-free: token i at position i)."""
    if m == span.num_tokens:
        return span
    ids = span.token_ids[:m]
    key = dataclasses.replace(span.key, tokens=token_digest(ids), num_tokens=m)
    return CompiledSpan(key, ids, span.k[:, :, :m].contiguous(), span.v[:, :, :m].contiguous())


def _is_kept(item: PlanItem) -> bool:
    return item.reuse and item.span.kind == "tool_output" and (item.span.name or "").startswith("handle ")


def _split(item: PlanItem, a: int, n: int, handle: str) -> list[PlanItem]:
    """``item`` as what comes before the kept answer (computed in context), the answer (reused: its KV
    is provided) and what comes after (computed in context)."""
    ids = item.span.token_ids
    out = []
    if a:
        out.append(PlanItem(Span(ids[:a], "tool_output"), reuse=False))
    out.append(PlanItem(Span(ids[a:a + n], "tool_output", f"handle {handle}")))
    if a + n < len(ids):
        out.append(PlanItem(Span(ids[a + n:], "tool_output"), reuse=False))
    return out
