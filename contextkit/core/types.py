"""Public value types that cross module boundaries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from contextkit.core.errors import EmptyInputError


@dataclass(frozen=True, slots=True)
class Evidence:
    """One retrieved document: what a retriever hands to contextkit."""

    text: str
    id: str | None = None
    title: str | None = None


SpanKind = Literal["document", "skill", "code", "tool_output", "system", "query"]


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


@dataclass(frozen=True, slots=True)
class Doc:
    """A document as ordering sees it: an id and its rendered token length."""

    id: str
    tokens: int


@dataclass(frozen=True, slots=True)
class OrderResult:
    """An ordering decision (``contextkit.ordering``)."""

    order: tuple[int, ...]  # permutation: order[i] = index into the retrieved list
    reusable_tokens: int  # expected prefix-cache hit, in whole blocks
    matched_docs: int  # how many leading documents the tree matched
    overhead_us: float


ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True, slots=True)
class Message:
    """One chat turn (content as text; the API edge joins OpenAI content parts into it)."""

    role: str
    content: str = ""
