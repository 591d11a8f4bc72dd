"""The fixed prompt template: how a document is written, and the chat frame the documents sit in.

The planner (``contextkit.core.planner``) is the one caller: every entry point renders through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using the documents. "
    "Answer briefly, in a few words."
)

# Splits the rendered chat text where the documents go. No client text may contain it: the planner
# refuses messages that do (a message holding it would move the split).
MARK = "\x00contextkit-documents\x00"


def render_document(doc: Evidence) -> str:
    """One document as a block: ``Document: title`` line, text, blank line.

    Nothing in the block depends on where the document lands (no index numbers), so the same document
    has the same tokens, and so reusable KV, in any request and at any rank.
    """
    head = "Document:" + (f" {doc.title}" if doc.title else "")
    return f"{head}\n{doc.text.strip()}\n\n"


def render_frame(
    tokenizer: Tokenizer, messages: Sequence[Message], with_documents: bool = True
) -> tuple[list[int], list[int]]:
    """Token ids before and after the documents of a chat.

    With documents they go at the start of the last user message, which becomes ``Question: <content>``;
    every earlier turn is kept as it is. Without documents the chat is rendered as it is (the suffix is
    empty), the tokens the model's own chat template gives.

    A model without a chat template (Gemma 3 270M in its wheel is a base model) gets a plain completion
    prompt: BOS, the system message, the documents, ``Question: ...\\nAnswer:``; other turns are dropped.
    """
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
    question = msgs[last]["content"].strip()
    if not tokenizer.has_chat_template:
        system = next((m["content"] for m in msgs if m["role"] == "system"), "")
        head = system + "\n\n" if system else ""
        return tokenizer.encode(head, add_special_tokens=True), tokenizer.encode(f"Question: {question}\nAnswer:")
    if not with_documents:
        return tokenizer.encode(tokenizer.render_chat(msgs)), []
    msgs[last]["content"] = MARK + f"Question: {question}"
    head, tail = tokenizer.render_chat(msgs).split(MARK)
    return tokenizer.encode(head), tokenizer.encode(tail)
