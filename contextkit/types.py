"""Public value types that cross module boundaries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Evidence:
    """One retrieved document: what a retriever hands to contextkit."""

    text: str
    id: str | None = None
    title: str | None = None
    score: float | None = None
