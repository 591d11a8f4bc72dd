"""LangChain adapters (extra ``langchain``: the real ``langchain-core``).

- ``ContextKitReorder``: a document compressor that orders retrieved documents for prefix reuse (the
  Weaver: the order most of which this tenant already served), for ``ContextualCompressionRetriever`` or
  an LCEL chain in front of any engine with a prefix cache.
- ``ChatContextKit``: a chat model backed by the SDK ``Client`` (in process or a serve/proxy URL). Pass the
  retrieved documents as ``documents=`` (``llm.invoke(messages, documents=docs)``, or ``llm.bind``): they
  go to contextkit as documents (spans on the KV path, ordered blocks on the prompt path), not as prompt
  text. The reuse report is in ``response_metadata["contextkit"]``; cached tokens in ``usage_metadata``.
- ``EvidenceRetriever``: any ``search(query) -> [Evidence]`` as a LangChain retriever.

A ``Document`` becomes ``Evidence(page_content, id=doc.id or metadata["id"], title=metadata["title"])``;
nothing else of its metadata is sent (so it need not be JSON-serialisable). The drop-in path needs none of
this: ``ChatOpenAI(base_url=<proxy>/v1, extra_body={"documents": [...]})`` works against the proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun, Callbacks
    from langchain_core.callbacks.manager import CallbackManagerForRetrieverRun
    from langchain_core.documents import BaseDocumentCompressor, Document
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.retrievers import BaseRetriever
    from pydantic import ConfigDict, Field, SecretStr
except ImportError as exc:  # pragma: no cover - exercised by a test in a subprocess
    raise ImportError("contextkit.integrations.frameworks.langchain needs langchain-core: "
                      "pip install 'contextkit[langchain]'") from exc

from contextkit.core.errors import InputError
from contextkit.core.types import Evidence, Message
from contextkit.integrations.frameworks.adapter import Reordering, client_of
from contextkit.sdk.shapes import Answer

ROLE = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool", "developer": "developer"}


def to_evidence(doc: Document | Evidence | str | dict, i: int = 0) -> Evidence | str | dict:
    """A LangChain ``Document`` as contextkit evidence (others pass through to the SDK's own checks)."""
    if not isinstance(doc, Document):
        return doc
    meta = doc.metadata or {}
    did, title = doc.id if doc.id is not None else meta.get("id"), meta.get("title")
    if did is not None and not isinstance(did, str | int):
        raise InputError(f"documents[{i}]: the id must be a string or an integer, got {type(did).__name__}",
                         "documents")
    if title is not None and not isinstance(title, str):
        raise InputError(f"documents[{i}]: metadata['title'] must be a string, got {type(title).__name__}",
                         "documents")
    if not isinstance(doc.page_content, str) or not doc.page_content.strip():
        raise InputError(f"documents[{i}] has no page_content; drop it or give it text", "documents")
    return Evidence(doc.page_content, id=None if did is None else str(did), title=title)


def to_messages(messages: Sequence[BaseMessage]) -> list[Message]:
    out = []
    for m in messages:
        role = ROLE.get(m.type)
        if role is None:
            raise InputError(f"a {m.type!r} message has no chat role contextkit knows ({sorted(ROLE)})", "messages")
        content = m.content if isinstance(m.content, str) else "".join(
            p if isinstance(p, str) else p.get("text", "")
            for p in m.content if isinstance(p, str) or p.get("type") == "text")
        out.append(Message(role, content))
    return out


def _metadata(a: Answer) -> tuple[dict, dict]:
    response = {"finish_reason": a.finish_reason, "model_name": a.model, "contextkit": a.report.as_dict(),
                "ttft_ms": a.ttft_ms, "total_ms": a.total_ms}
    usage = {"input_tokens": a.prompt_tokens, "output_tokens": a.completion_tokens,
             "total_tokens": a.prompt_tokens + a.completion_tokens,
             "input_token_details": {"cache_read": a.report.cached_tokens}}
    return response, usage


class ChatContextKit(BaseChatModel):
    """A LangChain chat model on contextkit (see the module docstring).

    Give ``client`` (``contextkit.connect(...)``), or ``base_url`` (a serve / proxy root) and ``api_key``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    client: Any = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    model_name: str | None = Field(default=None, alias="model")
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    reuse: Any = None  # None: the default; a ReuseOptions; False: full prefill (KV path)
    tenant: str | None = None
    timeout_s: float = 120.0

    def model_post_init(self, __context: Any) -> None:
        key = self.api_key.get_secret_value() if self.api_key else None
        self.client = client_of(self.client, self.base_url, key, self.model_name, self.timeout_s, "ChatContextKit")

    @property
    def _llm_type(self) -> str:
        return "contextkit"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model_name, "transport": self.client.transport.name, "max_tokens": self.max_tokens,
                "temperature": self.temperature}

    def _call_args(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> dict:
        docs = kwargs.pop("documents", None) or ()
        skills = kwargs.pop("skills", None) or ()
        args = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "reuse": self.reuse, "tenant": self.tenant} | kwargs
        if stop:
            args["stop"] = stop
        return {"prompt": to_messages(messages), "documents": [to_evidence(d, i) for i, d in enumerate(docs)],
                "skills": list(skills), **args}

    def _result(self, a: Answer) -> ChatResult:
        response, usage = _metadata(a)
        msg = AIMessage(content=a.text, response_metadata=response, usage_metadata=usage, id=a.id)
        return ChatResult(generations=[ChatGeneration(message=msg, generation_info={"finish_reason": a.finish_reason})],
                          llm_output={"contextkit": a.report.as_dict(), "model_name": a.model})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return self._result(self.client.generate(**self._call_args(messages, stop, kwargs)))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return self._result(await self.client.agenerate(**self._call_args(messages, stop, kwargs)))

    def _last_chunk(self, a: Answer) -> ChatGenerationChunk:
        response, usage = _metadata(a)
        return ChatGenerationChunk(message=AIMessageChunk(content="", response_metadata=response, usage_metadata=usage),
                                   generation_info={"finish_reason": a.finish_reason})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream = self.client.stream(**self._call_args(messages, stop, kwargs))
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.answer)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        stream = self.client.astream(**self._call_args(messages, stop, kwargs))
        async for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                await run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._last_chunk(stream.answer)


class ContextKitReorder(BaseDocumentCompressor, Reordering):
    """Orders retrieved documents so that the longest run this tenant already sent comes first (the Weaver's
    prefix tree over served orders; ties keep retrieval order). Returns the same ``Document`` objects.
    Settings (``block_size``, ``tenant``, ``count_tokens``): ``contextkit.integrations.frameworks.adapter.
    Reordering``."""

    def compress_documents(self, documents: Sequence[Document], query: str,
                           callbacks: Callbacks | None = None) -> Sequence[Document]:
        return [documents[i] for i in self.reordered([to_evidence(d, i) for i, d in enumerate(documents)])]


class EvidenceRetriever(BaseRetriever):
    """``search(query) -> [Evidence]`` (e.g. contextkit's faiss retriever) as a LangChain retriever."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    search: Callable[[str], Sequence[Evidence]]

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun) -> list[Document]:
        return [Document(page_content=e.text, id=e.id, metadata={"title": e.title, "id": e.id})
                for e in self.search(query)]
