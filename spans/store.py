"""Compiled spans and the store interface the span cache uses.

``SpanStore`` is the interface ``kvstore`` implements with real tiers (memory, disk, LMCache). The
``MemorySpanStore`` here is a byte-bounded LRU in process memory, enough for one process; every hit is
checked against the key (tokens, shapes, dtype) and a mismatch is dropped and counted, never served.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import torch

from contextkit.errors import ConfigError
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


class MemorySpanStore:
    """Byte-bounded LRU of compiled spans in this process."""

    def __init__(self, max_bytes: int = 2 << 30):
        if max_bytes <= 0:
            raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[SpanKey, CompiledSpan] = OrderedDict()
        self.bytes = 0
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "rejected": 0}

    def __contains__(self, key: SpanKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: SpanKey) -> CompiledSpan | None:
        entry = self._entries.get(key)
        if entry is None:
            self.stats["misses"] += 1
            return None
        if entry.problem(key) is not None:  # never serve a mismatched entry: drop it, recompute
            self._drop(key)
            self.stats["rejected"] += 1
            self.stats["misses"] += 1
            return None
        self._entries.move_to_end(key)
        self.stats["hits"] += 1
        return entry

    def put(self, span: CompiledSpan) -> None:
        if span.nbytes > self.max_bytes:
            return  # larger than the whole budget: not cached
        if span.key in self._entries:
            self._drop(span.key)
        self._entries[span.key] = span
        self.bytes += span.nbytes
        while self.bytes > self.max_bytes:
            old, _ = next(iter(self._entries.items()))
            self._drop(old)
            self.stats["evictions"] += 1

    def _drop(self, key: SpanKey) -> None:
        entry = self._entries.pop(key)
        self.bytes -= entry.nbytes
