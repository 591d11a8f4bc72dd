"""The engine seam: what the KV path (span cache, recompute policies) asks of an engine.

The built-in engine (``contextkit.engine.Engine``) is the one implementation today; a vLLM-backed KV
path plugs in by implementing the same few members. Everything here is a type: no engine code.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from contextkit.core.kvcache import Attend, KVCache
from contextkit.core.spec import ModelSpec

LogitsSelect = Literal["last", "all", "none"] | torch.Tensor


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """Identifies the weights and architecture: part of every span key."""

    model_type: str
    digest: str  # sha256 over config.json and the weight files' bytes, hex (contextkit.core.models)


class AttentionProbe(Protocol):
    """Sees the queries and keys of chosen layers during a forward (e.g. to score tokens by attention)."""

    layers: Collection[int]

    def observe(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> None:
        """q (H, rows, D) rotated; k (Hkv, T, D) the whole cache; mask (rows, T) bool or None = all visible."""


class KVEngine(Protocol):
    """A model whose KV lives in a caller-owned ``KVCache``.

    ``forward`` writes the KV of ``token_ids`` at ``positions`` into ``slots`` (appending by default),
    attending causally by slot order or per ``attend``, and returns the logits asked for. ``stop_after``
    runs only the first layers (their KV is written); ``probe`` observes attention.
    """

    spec: ModelSpec
    dtype: torch.dtype
    fingerprint: ModelFingerprint

    def new_cache(self, capacity: int) -> KVCache: ...

    def forward(
        self,
        cache: KVCache,
        token_ids: torch.Tensor | list[int],
        positions: torch.Tensor | Sequence[int] | None = None,
        segment: int | torch.Tensor = 0,
        attend: Attend | None = None,
        logits: LogitsSelect = "last",
        slots: torch.Tensor | Sequence[int] | None = None,
        stop_after: int | None = None,
        probe: AttentionProbe | None = None,
    ) -> torch.Tensor | None: ...
