"""Public value types that cross module boundaries."""

from __future__ import annotations

import hashlib
import re
from dataclasses import KW_ONLY, dataclass
from typing import Literal

from contextkit.core.errors import EmptyInputError

# a kept answer's handle (parallel agents over HTTP: ``synthesis.handles``): what our response ids look like,
# and a caller's own
HANDLE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def is_handle(value: object) -> bool:
    """Whether a named handle can be one (a string ``HANDLE`` matches); else it is read ``malformed``."""
    return isinstance(value, str) and HANDLE.fullmatch(value) is not None


def handle_name(value: object) -> str:
    """How a named handle is reported back: itself, or a non-string's repr, cut to 40 characters."""
    return value if isinstance(value, str) else repr(value)[:40]


@dataclass(frozen=True, slots=True)
class Evidence:
    """One retrieved document: what a retriever hands to contextkit. ``id`` and ``title`` are keyword-only
    (``Evidence(text, id=..., title=...)``): passed by position, two optional strings were once swapped."""

    text: str
    _: KW_ONLY
    id: str | None = None
    title: str | None = None


def skill_version(name: str, text: str) -> str:
    """A skill's version: a hash of its name and text (hex, 16 characters)."""
    return hashlib.sha256(f"skill-v1\x00{name}\x00{text}".encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Skill:
    """One version of a procedural skill as a request carries it (``contextkit.synthesis.skills`` keeps
    the library): its name, the text the model reads, the version (a hash of that text), and errata:
    (old, new) corrections rendered after the text, so the text's compiled KV stays valid."""

    name: str
    text: str
    version: str = ""
    description: str = ""
    errata: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.name.strip():
            raise EmptyInputError("a skill needs a name")
        if not self.text or not self.text.strip():
            raise EmptyInputError(f"skill {self.name!r} has no text; give it the body of its SKILL.md")


SpanKind = Literal["document", "skill", "code", "tool_output", "history", "system", "query"]


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Doc:
    """A document as ordering sees it: an id and its rendered token length (``Doc(id=..., tokens=...)``)."""

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
