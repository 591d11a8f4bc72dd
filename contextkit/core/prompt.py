"""The fixed prompt template: how a document is written, and the chat frame the documents sit in.

The planner (``contextkit.core.planner``) is the one caller: every entry point renders through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from contextkit.core.errors import InputError
from contextkit.core.types import Evidence, Message, Skill

if TYPE_CHECKING:  # the HTTP client plans nothing: it need not install tokenizers
    from contextkit.core.tokenizer import Tokenizer

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using the documents. "
    "Answer briefly, in a few words."
)

# Splits the rendered chat text where the documents go. No client text may contain it: the planner
# refuses messages that do (a message holding it would move the split).
MARK = "\x00contextkit-documents\x00"
SKILLS_MARK = "\x00contextkit-skills\x00"  # where skills go: the end of the system message
TURN_MARK = "\x00contextkit-turn\x00"  # the start of each assistant message's content: where a conversation is cut


def render_skill(skill: Skill) -> str:
    """One skill as a block: ``Skill: name`` line, its text, blank line (the same tokens wherever it
    lands; its errata are blocks of their own, after it)."""
    return f"Skill: {skill.name}\n{skill.text.strip()}\n\n"


def render_erratum(old: str, new: str) -> str:
    """A correction appended after a skill instead of recompiling it."""
    return f'Correction: in this skill, "{old}" is now "{new}". Use "{new}" wherever the skill says "{old}".\n\n'


def render_document(doc: Evidence) -> str:
    """One document as a block: ``Document: title`` line, text, blank line.

    Nothing in the block depends on where the document lands (no index numbers), so the same document
    has the same tokens, and so reusable KV, in any request and at any rank.
    """
    head = "Document:" + (f" {doc.title}" if doc.title else "")
    return f"{head}\n{doc.text.strip()}\n\n"


RELEVANCE_HINTS = ("none", "titles", "positions")
HINT_LIMIT = 16  # at most this many documents are named in a hint (the most relevant ones)


def render_relevance_hint(docs: Sequence[Evidence], order: Sequence[int], style: str) -> str:
    """One line that gives back the retrieval (relevance) order of documents served in ``order``.

    Reordering documents for the prefix cache is exact KV but a different prompt; the line, placed after
    the documents and before the question (outside the cached prefix), tells the model which ones the
    retriever ranked first. ``docs`` are in retrieval order; ``order[j]`` is the retrieval rank of the
    document served ``j``-th. Empty when nothing was reordered or ``style`` is "none"; else
    ``relevance_line``.
    """
    if style not in RELEVANCE_HINTS:
        raise InputError(f"relevance_hint must be one of {RELEVANCE_HINTS}, got {style!r}", "contextkit")
    if style == "none" or tuple(order) == tuple(range(len(order))):
        return ""
    return relevance_line(docs, order, style)


def relevance_line(docs: Sequence[Evidence], order: Sequence[int], style: str) -> str:
    """The relevance line whatever the order: ``titles`` names each document by its title (by its place in
    the prompt when it has none), ``positions`` by its place from 1; the first ``HINT_LIMIT`` by rank."""
    place = {rank: j + 1 for j, rank in enumerate(order)}  # retrieval rank -> place in the prompt (from 1)
    ranked = sorted(place)[:HINT_LIMIT]
    if style == "positions":
        return ("Documents by relevance, most relevant first (numbered from 1 as they appear above): "
                + " > ".join(str(place[r]) for r in ranked) + "\n")
    names = [" ".join((docs[r].title or "").split()) or f"document {place[r]}" for r in ranked]
    return "Documents by relevance, most relevant first: " + " > ".join(names) + "\n"


Part = tuple[tuple[int, ...], ...]  # a part of a rendered chat, as pieces of token ids


def render_pieces(
    tokenizer: Tokenizer, messages: Sequence[Message], with_documents: bool = True, with_skills: bool = False,
    documents_at: str = "last",
) -> tuple[Part, Part, Part]:
    """A chat's tokens before the skills or documents, between them, and after the documents, each part cut
    into pieces where an assistant message's content starts.

    A request ends with the generation prompt, which is where the next request of the conversation puts
    the model's answer: cut there, every piece of a request is a piece of the next one, so the next
    request can reuse all of it as an exact prefix and compute only the answer and what follows it. The
    pieces join into exactly the tokens the whole part encodes to (a part where a token would straddle a
    cut stays one piece, and a template that rewrites message content gets no cuts).

    With documents they go at the start of the last user message (``documents_at="first"``: the first
    one, so later turns follow them, the layout of a multi-turn session whose documents stay in place),
    which becomes ``Question: <content>``; every other turn is kept as it is. Without documents the chat
    is rendered as it is (the suffix is
    empty), the tokens the model's own chat template gives.

    With skills, they go at the end of the system message (one is added if the chat has none), after
    a blank line: ``head`` ends there, ``middle`` runs from the end of the system message to the
    documents. Returns (head, middle, tail); without skills ``middle`` is empty and ``head`` runs to the
    documents.

    A model without a chat template (Gemma 3 270M in its wheel is a base model) gets a plain completion
    prompt: BOS, the system message, the skills, the documents, ``Question: ...\\nAnswer:``; other turns
    are dropped.
    """
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    last = users[0] if documents_at == "first" else users[-1]
    question = msgs[last]["content"].strip()
    if not tokenizer.has_chat_template:
        system = next((m["content"] for m in msgs if m["role"] == "system"), "")
        head = system + "\n\n" if system else ""
        question = msgs[users[-1]]["content"].strip()  # one turn only: the last question
        return ((tuple(tokenizer.encode(head, add_special_tokens=True)),), (),
                (tuple(tokenizer.encode(f"Question: {question}\nAnswer:")),))
    if with_skills:
        sys_at = next((i for i, m in enumerate(msgs) if m["role"] == "system"), None)
        if sys_at is None:
            msgs.insert(0, {"role": "system", "content": SKILLS_MARK})
            last += 1
        else:
            text = msgs[sys_at]["content"].rstrip()
            msgs[sys_at]["content"] = (text + "\n\n" if text else "") + SKILLS_MARK
    if with_documents:
        msgs[last]["content"] = MARK + f"Question: {question}"
    text = tokenizer.render_chat(msgs)
    if any(m["role"] == "assistant" for m in msgs):  # cuts: rendered again with a mark where each answer starts
        marked = tokenizer.render_chat([dict(m, content=TURN_MARK + m["content"]) if m["role"] == "assistant"
                                        else m for m in msgs])
        if marked.replace(TURN_MARK, "") == text:  # else the template rewrites content (strips it): no cuts
            text = marked
    head, middle = text.split(SKILLS_MARK) if with_skills else (text, "")
    if not with_documents:
        # no documents: everything after the skills is the query (without skills, the whole chat is)
        parts = (head, "", middle) if with_skills else (head, "", "")
    elif with_skills:
        middle, tail = middle.split(MARK)
        parts = (head, middle, tail)
    else:
        head, tail = head.split(MARK)
        parts = (head, "", tail)
    out = []
    for part in parts:
        pieces = [tuple(tokenizer.encode(run)) for run in part.split(TURN_MARK) if run]
        if len(pieces) > 1:
            whole = tuple(tokenizer.encode(part.replace(TURN_MARK, "")))
            if tuple(t for p in pieces for t in p) != whole:  # a token spans a cut: the part stays whole
                pieces = [whole]
        out.append(tuple(p for p in pieces if p))
    return out[0], out[1], out[2]
