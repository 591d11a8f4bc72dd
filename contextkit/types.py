"""Public value types that cross module boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from contextkit.errors import EmptyInputError


@dataclass(frozen=True, slots=True)
class Evidence:
    """One retrieved document: what a retriever hands to contextkit."""

    text: str
    id: str | None = None
    title: str | None = None
    score: float | None = None


SpanKind = Literal["document", "skill", "code", "tool_output", "separator", "system", "query"]


@dataclass(frozen=True, slots=True)
class Span:
    """A run of tokens whose KV may be cached and reused at any position.

    ``kind`` is metadata (what the tokens are); it does not change the KV and is not part of the key.
    """

    token_ids: tuple[int, ...]
    kind: SpanKind = "document"
    name: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise EmptyInputError(f"span {self.name or ''} has no tokens; drop it or give it text".replace("  ", " "))
