"""Compiled spans and the store interface the span cache uses.

``SpanStore`` is what the span cache asks of a store; ``KVSpanStore`` keeps spans in ``kvstore``'s
tiers (memory, LMCache disk, LMCache remote) and checks every hit against the key (tokens, shapes,
dtype); a mismatch is dropped and counted, never served.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from contextkit.spans.key import SpanKey, token_digest


@dataclass(frozen=True, slots=True)
class CompiledSpan:
    """A span's KV, position-free: keys rotated as if the span started at position 0."""

    key: SpanKey
    token_ids: tuple[int, ...]
    k: torch.Tensor  # (layers, kv_heads, n, head_dim), token i rotated to position i
    v: torch.Tensor  # (layers, kv_heads, n, head_dim)
    compile_ms: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def problem(self, key: SpanKey) -> str | None:
        """Why this entry must not be served for ``key`` (None if it is sound)."""
        if self.key != key:
            return "key mismatch"
        if len(self.token_ids) != key.num_tokens:
            return "token count mismatch"
        if self.k.shape != self.v.shape or self.k.shape[2] != key.num_tokens:
            return f"shape mismatch {tuple(self.k.shape)} / {tuple(self.v.shape)}"
        if str(self.k.dtype).removeprefix("torch.") != key.identity.dtype:
            return f"dtype {self.k.dtype} != {key.identity.dtype}"
        if token_digest(self.token_ids) != key.tokens:
            return "token ids do not match the key"
        return None


class SpanStore(Protocol):
    def get(self, key: SpanKey) -> CompiledSpan | None: ...

    def put(self, span: CompiledSpan) -> None: ...

    def __contains__(self, key: SpanKey) -> bool: ...


LAYOUT = "k,v:(layers,kv_heads,tokens,head_dim) rotated at position 0; token_ids:(tokens,)"


class KVSpanStore:
    """Compiled spans kept in a ``kvstore`` (memory, LMCache disk, LMCache remote tiers).

    A span is one entry: K, V and its token ids. kvstore checks bytes and keys (checksum, digest,
    tenant); this layer checks what the bytes mean (``CompiledSpan.problem``: key, token count,
    shapes, dtype, token ids against the key). Either failure drops the entry from every tier, counts
    it under ``rejected`` and answers a miss, so the span is recompiled, never served wrong.
    """

    def __init__(self, store=None):
        if store is None:
            from contextkit.kvstore.memory import MemoryTier
            from contextkit.kvstore.tiered import TieredStore

            store = TieredStore([MemoryTier()])
        self.kv = store
        self.stats = {"hits": 0, "misses": 0, "rejected": 0}

    def __contains__(self, key: SpanKey) -> bool:
        return self.kv.contains(key)

    def get(self, key: SpanKey) -> CompiledSpan | None:
        entry = self.kv.get(key)
        if entry is None:
            self.stats["misses"] += 1
            return None
        t = entry.tensors
        try:
            span = CompiledSpan(key, tuple(t["token_ids"].tolist()), t["k"], t["v"], entry.meta.cost_ms)
            problem = span.problem(key)
        except KeyError as exc:
            problem = f"missing tensor {exc}"
        if problem is not None:  # never serve it: drop everywhere, recompute
            self.kv.delete(key)
            self.stats["rejected"] += 1
            self.stats["misses"] += 1
            return None
        self.stats["hits"] += 1
        return span

    def put(self, span: CompiledSpan) -> None:
        from contextkit.kvstore.entry import make_entry

        ids = torch.tensor(span.token_ids, dtype=torch.int64)
        self.kv.put(span.key, make_entry(span.key, {"k": span.k, "v": span.v, "token_ids": ids}, LAYOUT,
                                         cost_ms=span.compile_ms))
