"""Block-aligned rendering for engines that reuse KV in fixed-size blocks.

vLLM's prefix cache hashes whole blocks (16 tokens on GPU, a multiple of 32 on CPU): a block that holds
the end of one document and the start of the next is reusable only when both neighbours repeat. Padding
the prompt's fixed prefix and every document to a multiple of the block size puts every document
boundary on a block boundary, so a document's blocks depend only on the documents before it, at the cost
of the pad tokens (which the engine prefills and the model reads: an unmodified vLLM cannot mask them).
``contextkit bench ordering`` measures whether that pays. The planner applies it (``ChatRequest.block_align``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contextkit.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Aligned:
    prefix: tuple[int, ...]
    documents: tuple[tuple[int, ...], ...]
    padding: int  # pad tokens added in all

    def ids(self, suffix: Sequence[int]) -> list[int]:
        return [*self.prefix, *(t for d in self.documents for t in d), *suffix]


def pad_to_block(tokens: Sequence[int], block_size: int, pad_id: int) -> tuple[int, ...]:
    """``tokens`` followed by ``pad_id`` up to the next multiple of ``block_size`` (unchanged if aligned)."""
    if block_size < 1:
        raise ConfigError(f"block_size must be >= 1, got {block_size}")
    return (*tokens, *([pad_id] * (-len(tokens) % block_size)))


def align(
    prefix: Sequence[int], documents: Sequence[Sequence[int]], block_size: int, pad_id: int
) -> Aligned:
    """Pad the prefix and each document so every document starts on a block boundary."""
    p = pad_to_block(prefix, block_size, pad_id)
    docs = tuple(pad_to_block(d, block_size, pad_id) for d in documents)
    padding = len(p) - len(prefix) + sum(len(a) - len(d) for a, d in zip(docs, documents))
    return Aligned(p, docs, padding)
