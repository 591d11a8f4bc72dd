"""The KV cache as an explicit, caller-owned object, and the attention structure over its slots.

Layout. Slot ``i`` of a cache holds one token: its key, rotated to ``positions[i]``, and its value, for
every layer. ``positions`` are logical RoPE positions and need not be ``0..n-1``: a span placed at
position 900 occupies slots 0..len-1 with positions 900..900+len-1.

Why keys are stored rotated (not pre-RoPE). Attention over rotated keys is plain SDPA with no per-step
rotation of the whole cache. Position independence lives one level up: a compiled span is stored
rotated to position 0 (``spans``/``kvstore``) and re-rotated by ``kernels`` when it is laid into a cache
at its new positions, one rotation per token.

Attention structure. Every slot belongs to a segment (an int). A token of segment ``s`` sees
- the earlier-or-same slots of its own segment (causal within the segment), and
- every slot of the segments listed in ``attend[s]`` (its declared predecessors).
``attend=None`` means plain causal attention over all slots in slot order. On sliding-window layers a
token additionally sees only keys whose position is within the window: ``q_pos - k_pos < window``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from contextkit.core.errors import KVCacheError

Attend = Mapping[int, Collection[int]]


@dataclass(eq=False)
class KVCache:
    """KV for one sequence. Mutable state the caller owns; the engine writes slots ``length..``."""

    k: torch.Tensor  # (layers, kv_heads, capacity, head_dim), rotated to `positions`
    v: torch.Tensor  # (layers, kv_heads, capacity, head_dim)
    positions: torch.Tensor  # (capacity,) int64 logical position of each slot
    segments: torch.Tensor  # (capacity,) int64 segment id of each slot
    length: int = 0

    @classmethod
    def allocate(
        cls, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype
    ) -> KVCache:
        if capacity <= 0:
            raise KVCacheError(f"KV cache capacity must be positive, got {capacity}")
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype),
            v=torch.zeros(shape, dtype=dtype),
            positions=torch.full((capacity,), -1, dtype=torch.int64),
            segments=torch.zeros(capacity, dtype=torch.int64),
        )

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def next_position(self) -> int:
        """The position after the last filled slot (0 for an empty cache)."""
        return 0 if self.length == 0 else int(self.positions[self.length - 1]) + 1

    def truncate(self, length: int) -> None:
        """Forget slots ``length..``; their memory is reused by the next write."""
        if not 0 <= length <= self.length:
            raise KVCacheError(f"cannot truncate a cache of length {self.length} to {length}")
        self.positions[length : self.length] = -1
        self.length = length

    def clone(self) -> KVCache:
        """A deep copy (e.g. to fork a shared prefix into several continuations)."""
        return KVCache(
            k=self.k.clone(), v=self.v.clone(), positions=self.positions.clone(),
            segments=self.segments.clone(), length=self.length,
        )

    def reserve(self, n: int) -> tuple[int, int]:
        """Claim ``n`` slots after the filled ones; returns (start, end)."""
        start, end = self.length, self.length + n
        if end > self.capacity:
            raise KVCacheError(
                f"KV cache full: {self.length} slots used, {n} more requested, capacity {self.capacity}; "
                "allocate a larger cache (Engine.new_cache(capacity=...))"
            )
        return start, end


PAD_SEGMENT = -1  # slots left empty by block-aligned padding: never attended to


def causal_mask(q_slots: torch.Tensor, end: int) -> torch.Tensor:
    """(len(q_slots), end) bool: each query slot sees key slots up to and including its own."""
    return torch.arange(end)[None, :] <= q_slots[:, None]


def attention_mask(
    cache: KVCache, q_slots: torch.Tensor, end: int, attend: Attend | None, window: int | None
) -> torch.Tensor | None:
    """Boolean mask (len(q_slots), end): query slots against key slots 0..end-1. True = may attend.

    Causality is by slot order. Returns None in the two cases SDPA handles without a mask: queries
    that are exactly slots 0..end-1 under plain causal attention (use ``is_causal``), and one query in
    the last slot that may see every slot.
    """
    k_slots = torch.arange(end)
    seg = cache.segments[:end]
    has_pad = bool((seg == PAD_SEGMENT).any())
    if attend is None and not has_pad and (window is None or _span(cache.positions[:end]) < window):
        n = q_slots.numel()
        if n == end and bool((q_slots == k_slots).all()):
            return None  # is_causal fast path
        if n == 1 and int(q_slots[0]) == end - 1:
            return None  # one query sees everything before it
    causal = causal_mask(q_slots, end)
    if attend is None:
        allowed = causal
    else:
        seg_q = seg[q_slots]
        allowed = (seg[None, :] == seg_q[:, None]) & causal
        for s in seg_q.unique().tolist():
            visible = [int(x) for x in attend.get(s, ())]
            if visible:
                rows = seg_q == s
                allowed[rows] |= torch.isin(seg, torch.tensor(visible, dtype=seg.dtype))[None, :]
    if has_pad:
        allowed &= (seg != PAD_SEGMENT)[None, :]
    if window is not None:
        pos = cache.positions[:end]
        allowed &= (pos[q_slots, None] - pos[None, :]) < window
    return allowed


def _span(positions: torch.Tensor) -> int:
    valid = positions[positions >= 0]
    return int(valid.max() - valid.min()) if valid.numel() else 0
