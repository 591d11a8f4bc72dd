"""The SDK client and its multi-turn sessions, on any transport (``contextkit.sdk.shapes``).

    client = contextkit.connect()                                  # in process, built-in engine
    client = contextkit.connect("http://localhost:8000", api_key=KEY)   # contextkit serve or proxy
    answer = client.generate("Who wrote Dune?", documents=["Dune was written by Frank Herbert."])
    answer.text, answer.report.reused_tokens

A ``Session`` keeps a conversation (questions, answers, tool outputs) and the documents it has seen.
Every turn re-sends the conversation in one layout: the session's documents open the first user
message (``documents_at="first"``), in the order first seen, and later turns follow them, so each
turn's prompt starts with the previous turn's documents (vLLM's prefix cache holds them; on the KV path
they are span hits). A document the session already holds is not sent twice: it is listed in the
answer's ``report.skipped_documents``. A conversation that outgrows the model's context raises
``PromptTooLongError`` (a 413 over HTTP): start a new session (nothing is dropped silently).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from contextkit.core.errors import ConfigError, EmptyInputError, InputError
from contextkit.core.planner import content_id
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import ROLES, Evidence, Message, Skill
from contextkit.sdk.shapes import Answer, Call, Transport

DocumentLike = Evidence | str | dict
MessageLike = Message | dict


def evidence(doc: DocumentLike, where: str = "documents") -> Evidence:
    """A document as ``Evidence``: an Evidence, a string (its text) or a dict with ``text`` (``title`` and
    ``id`` optional; other keys are refused so a misspelt field is not silently dropped)."""
    if isinstance(doc, Evidence):
        out = doc
    elif isinstance(doc, str):
        out = Evidence(text=doc)
    elif isinstance(doc, dict):
        extra = set(doc) - {"text", "title", "id"}
        if extra:
            raise InputError(f"{where}: unknown document fields {sorted(extra)}; a document is "
                             "{\"text\", \"title\", \"id\"}", "documents")
        text, title, did = doc.get("text"), doc.get("title"), doc.get("id")
        if not isinstance(text, str) or (title is not None and not isinstance(title, str)):
            raise InputError(f"{where}: a document's text (and title) must be strings", "documents")
        out = Evidence(text=text, id=None if did is None else str(did), title=title)
    else:
        raise InputError(f"{where}: a document is a string, a dict with \"text\" or an Evidence, got "
                         f"{type(doc).__name__}", "documents")
    if not out.text or not out.text.strip():
        raise EmptyInputError(f"{where}: a document has no text; drop it or give it content", "documents")
    return out


def message(m: MessageLike) -> Message:
    if isinstance(m, Message):
        return m
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise InputError(f"a message is a dict with a role in {ROLES} and its content, got {m!r:.80}", "messages")
    content = m.get("content") or ""
    if not isinstance(content, str):
        raise InputError("message content must be a string (join content parts first)", "messages")
    return Message(m["role"], content)


def _messages(prompt: str | Sequence[MessageLike], system: str | None) -> tuple[Message, ...]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise EmptyInputError("the question is empty; pass a question or a list of messages", "messages")
        return ((Message("system", system),) if system else ()) + (Message("user", prompt),)
    msgs = tuple(message(m) for m in prompt)
    if system and not any(m.role == "system" for m in msgs):
        msgs = (Message("system", system),) + msgs
    if not any(m.role == "user" for m in msgs):
        raise InputError("messages need a user message (the question)", "messages")
    return msgs


class TextStream:
    """Iterate for text deltas; afterwards ``answer`` holds the Answer (report and all)."""

    def __init__(self, items: Iterator[str | Answer]):
        self._items, self.answer = items, None

    def __iter__(self) -> Iterator[str]:
        for item in self._items:
            if isinstance(item, Answer):
                self.answer = item
            else:
                yield item

    def finish(self) -> Answer:
        for _ in self:
            pass
        if self.answer is None:
            raise ConfigError("the transport ended the stream without an answer")
        return self.answer


class AsyncTextStream:
    """``async for`` text deltas; afterwards ``answer`` holds the Answer."""

    def __init__(self, items: AsyncIterator[str | Answer]):
        self._items, self.answer = items, None

    async def __aiter__(self) -> AsyncIterator[str]:
        async for item in self._items:
            if isinstance(item, Answer):
                self.answer = item
            else:
                yield item

    async def finish(self) -> Answer:
        async for _ in self:
            pass
        if self.answer is None:
            raise ConfigError("the transport ended the stream without an answer")
        return self.answer


class Client:
    """One client, two transports, the same methods (see the module docstring). Thread-safe as its
    transport is; ``close()`` (or ``with``) releases it."""

    def __init__(self, transport: Transport):
        self.transport = transport

    @property
    def skills(self):
        """The transport's skill library (``register(folder)``, ``get``, ``retrieve``)."""
        return self.transport.skills

    def call(
        self,
        prompt: str | Sequence[MessageLike],
        documents: Sequence[DocumentLike] = (),
        skills: Sequence[Skill | str] = (),
        *,
        system: str | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        reuse: ReuseOptions | bool | None = None,
        ordering: str = "weaver",
        tenant: str | None = None,
        documents_at: str = "last",
        keep: bool = False,
        handles: Sequence[str] | str = (),
    ) -> Call:
        """The ``Call`` the other methods send: a question (``system``: None = the server's default RAG
        prompt when there are documents) or chat messages; documents as strings, dicts or Evidence; skills
        as Skill or the name of one in ``self.skills``. ``reuse=True`` is the default policy. ``keep`` and
        ``handles``: parallel agents over HTTP (serve): keep this answer's KV under its id; the ids of kept
        answers this call carries as text (read from their KV where their text is found), or "auto" (the
        tenant's recent kept answers, wherever their text is)."""
        if reuse is True:
            reuse = ReuseOptions()
        if reuse is not None and reuse is not False and not isinstance(reuse, ReuseOptions):
            raise ConfigError("reuse is None (the default), True, False (full prefill) or a ReuseOptions")
        stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        return Call(
            _messages(prompt, system), tuple(evidence(d, f"documents[{i}]") for i, d in enumerate(documents)),
            tuple(s if isinstance(s, Skill) else self.transport.skill(s) for s in skills), max_tokens, temperature,
            top_p, stops, seed, reuse, ordering, tenant, documents_at, keep,
            handles if isinstance(handles, str) else tuple(handles),  # type: ignore[arg-type]
        )

    def generate(self, prompt: str | Sequence[MessageLike], documents: Sequence[DocumentLike] = (),
                 skills: Sequence[Skill | str] = (), **kw: Any) -> Answer:
        """Answer ``prompt`` over ``documents`` (keywords: see ``call``)."""
        return self.transport.complete(self.call(prompt, documents, skills, **kw))

    def stream(self, prompt: str | Sequence[MessageLike], documents: Sequence[DocumentLike] = (),
               skills: Sequence[Skill | str] = (), **kw: Any) -> TextStream:
        """Iterate the returned stream for text deltas; its ``answer`` holds the Answer afterwards."""
        return TextStream(self.transport.stream(self.call(prompt, documents, skills, **kw)))

    async def agenerate(self, prompt: str | Sequence[MessageLike], documents: Sequence[DocumentLike] = (),
                        skills: Sequence[Skill | str] = (), **kw: Any) -> Answer:
        return await self.transport.acomplete(self.call(prompt, documents, skills, **kw))

    def astream(self, prompt: str | Sequence[MessageLike], documents: Sequence[DocumentLike] = (),
                skills: Sequence[Skill | str] = (), **kw: Any) -> AsyncTextStream:
        return AsyncTextStream(self.transport.astream(self.call(prompt, documents, skills, **kw)))

    def session(self, system: str | None = None, **defaults: Any) -> Session:
        """A multi-turn conversation; ``defaults`` are ``call`` keywords used by every turn."""
        return Session(self, system, **defaults)

    def fork(self, prefix: str | Sequence[MessageLike], prompts: Sequence[str], documents: Sequence[DocumentLike] = (),
             **kw: Any):
        """N worker branches over one prefix, then ``join`` them: in process their KV is shared and read
        from the fork; over HTTP (serve) each worker is a chat that keeps its answer's KV, read by the join."""
        fork = getattr(self.transport, "fork", None)
        if fork is None:
            raise ConfigError(f"fork/join read branch KV, which needs the KV path in this process; the "
                              f"{self.transport.name} transport sends text. Use contextkit.connect() without a URL "
                              "(the built-in engine: pip install 'contextkit[local]')")
        return fork(self, prefix, prompts, documents, **kw)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A conversation on one client: ``ask`` a question (with the documents retrieved for it), ``tool``
    to add a tool's output; ``steps`` holds every turn's Answer (its report says what was reused)."""

    def __init__(self, client: Client, system: str | None = None, **defaults: Any):
        for k in ("documents_at", "documents", "skills"):
            if k in defaults:
                raise ConfigError(f"{k} is not a session default; a session places its documents itself")
        self.client, self.system, self.defaults = client, system, defaults
        self.messages: list[Message] = []
        self.documents: list[Evidence] = []
        self._keys: dict[str, str] = {}  # document id -> content digest
        self.steps: list[Answer] = []

    def _admit(self, documents: Sequence[DocumentLike]) -> tuple[str, ...]:
        """Add the new documents to the session; the ids of those it already held."""
        skipped = []
        for i, d in enumerate(documents):
            doc = evidence(d, f"documents[{i}]")
            digest = content_id(doc)  # of the title and text, whatever the id
            did = doc.id or digest
            if did in self._keys:
                if self._keys[did] != digest:
                    raise InputError(f"document id {did!r} was sent earlier in this session with other text; "
                                     "give the new text its own id", "documents")
                skipped.append(did)
                continue
            self._keys[did] = digest
            self.documents.append(doc if doc.id else dataclasses.replace(doc, id=did))
        return tuple(skipped)

    def _turn(self, question: str, documents: Sequence[DocumentLike], skills, kw) -> tuple[Call, tuple[str, ...]]:
        if not question or not question.strip():
            raise EmptyInputError("the question is empty", "messages")
        skipped = self._admit(documents)
        msgs = ([Message("system", self.system)] if self.system else []) + self.messages + [Message("user", question)]
        call = self.client.call(msgs, self.documents, skills, **{**self.defaults, **kw}, documents_at="first")
        return call, skipped

    def _record(self, question: str, answer: Answer, skipped: tuple[str, ...]) -> Answer:
        answer = dataclasses.replace(answer, report=dataclasses.replace(answer.report, skipped_documents=skipped))
        self.messages += [Message("user", question), Message("assistant", answer.text)]
        self.steps.append(answer)
        return answer

    def ask(self, question: str, documents: Sequence[DocumentLike] = (), skills: Sequence[Skill | str] = (),
            **kw: Any) -> Answer:
        """One turn: the answer to ``question`` given the conversation and every document so far."""
        call, skipped = self._turn(question, documents, skills, kw)
        return self._record(question, self.client.transport.complete(call), skipped)

    def stream(self, question: str, documents: Sequence[DocumentLike] = (), skills: Sequence[Skill | str] = (),
               **kw: Any) -> TextStream:
        """``ask``, streamed: iterate for deltas; the turn is recorded when the stream ends."""
        call, skipped = self._turn(question, documents, skills, kw)

        def items() -> Iterator[str | Answer]:
            for item in self.client.transport.stream(call):
                yield self._record(question, item, skipped) if isinstance(item, Answer) else item

        return TextStream(items())

    async def aask(self, question: str, documents: Sequence[DocumentLike] = (), skills: Sequence[Skill | str] = (),
                   **kw: Any) -> Answer:
        call, skipped = self._turn(question, documents, skills, kw)
        return self._record(question, await self.client.transport.acomplete(call), skipped)

    def tool(self, name: str, output: str) -> None:
        """A tool's output, as the next turn of the conversation (role ``tool``)."""
        if not output or not output.strip():
            raise EmptyInputError(f"tool {name!r} returned no output; say so in text (e.g. \"(no output)\")")
        if not self.messages:
            raise InputError("a tool output follows a turn; ask first", "messages")
        self.messages.append(Message("tool", f"[{name}]\n{output}"))


async def athread(items: Iterator[Any]) -> AsyncIterator[Any]:
    """Items of a blocking iterator, produced on a worker thread, for ``async for`` (in-process transports)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    def pump() -> None:
        try:
            for item in items:
                loop.call_soon_threadsafe(queue.put_nowait, item)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, done)

    task = loop.run_in_executor(None, pump)
    while (item := await queue.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
    await task
