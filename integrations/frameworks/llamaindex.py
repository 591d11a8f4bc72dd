"""LlamaIndex adapters (extra ``llamaindex``: the real ``llama-index-core``).

- ``ContextKitReorderPostprocessor``: a node postprocessor that orders retrieved nodes for prefix reuse
  (the Weaver, as ``ContextKitReorder`` does for LangChain).
- ``ContextKitLLM``: a chat-native LLM (``CustomLLM`` with ``chat`` / ``complete`` and their streaming
  and async forms) backed by the SDK ``Client``. ``complete(prompt, documents=nodes)`` sends the nodes as
  documents (spans on the KV path, ordered blocks on the prompt path); the reuse report is in the
  response's ``additional_kwargs["contextkit"]``.
- ``ContextKitQueryEngine``: retriever -> (postprocessors) -> ``ContextKitLLM`` with the retrieved nodes
  as documents, not as prompt text; ``EvidenceRetriever`` wraps any ``search(query) -> [Evidence]``.

A node becomes ``Evidence(node.get_content(), id=node.node_id, title=metadata["title"])``; nothing else of
its metadata is sent. The drop-in path needs none of this: ``OpenAILike(api_base=<proxy>/v1, ...)`` with
``additional_kwargs={"extra_body": {"documents": [...]}}`` works against the proxy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
    )  # fmt: skip
    from llama_index.core.base.response.schema import Response
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
    from pydantic import ConfigDict, Field
except ImportError as exc:  # pragma: no cover - exercised by a test in a subprocess
    raise ImportError("contextkit.integrations.frameworks.llamaindex needs llama-index-core: "
                      "pip install 'contextkit[llamaindex]'") from exc

from contextkit.core.errors import InputError
from contextkit.core.planner import content_id
from contextkit.core.types import Evidence, Message
from contextkit.integrations.frameworks.adapter import Reordering, client_of
from contextkit.sdk.shapes import Answer


def to_evidence(node: Any, i: int = 0) -> Evidence | str | dict:
    """A LlamaIndex node (or NodeWithScore) as contextkit evidence; others pass through to the SDK's checks."""
    if isinstance(node, NodeWithScore):
        node = node.node
    if not hasattr(node, "get_content") or not hasattr(node, "node_id"):
        return node
    text = node.get_content()
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"documents[{i}] (node {node.node_id}) has no text; drop it or give it content", "documents")
    title = (node.metadata or {}).get("title")
    if title is not None and not isinstance(title, str):
        raise InputError(f"documents[{i}]: metadata['title'] must be a string, got {type(title).__name__}",
                         "documents")
    return Evidence(text, id=str(node.node_id), title=title)


def to_messages(messages: Sequence[ChatMessage]) -> list[Message]:
    out = []
    for m in messages:
        role = m.role.value if hasattr(m.role, "value") else str(m.role)
        role = {"chatbot": "assistant", "model": "assistant", "function": "tool"}.get(role, role)
        out.append(Message(role, m.content or ""))
    return out


def _extra(a: Answer) -> dict:
    return {"contextkit": a.report.as_dict(), "finish_reason": a.finish_reason, "ttft_ms": a.ttft_ms,
            "total_ms": a.total_ms, "prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
            "cached_tokens": a.report.cached_tokens}


class ContextKitLLM(CustomLLM):
    """A LlamaIndex LLM on contextkit. Give ``client`` (``contextkit.connect(...)``), or ``base_url`` (a
    serve / proxy root) and ``api_key``."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    client: Any = None
    base_url: str | None = None
    api_key: str | None = Field(default=None, repr=False)
    model: str | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    context_window: int = 8192
    reuse: Any = None
    tenant: str | None = None
    timeout_s: float = 120.0

    def model_post_init(self, __context: Any) -> None:
        self.client = client_of(self.client, self.base_url, self.api_key, self.model, self.timeout_s, "ContextKitLLM")

    @classmethod
    def class_name(cls) -> str:
        return "contextkit_llm"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_tokens, is_chat_model=True,
                           model_name=self.model or f"contextkit ({self.client.transport.name})")

    def _args(self, prompt, kwargs: dict) -> dict:
        docs = kwargs.pop("documents", None) or ()
        kwargs.pop("formatted", None)
        skills = kwargs.pop("skills", None) or ()
        args = {"max_tokens": self.max_tokens, "temperature": self.temperature, "reuse": self.reuse,
                "tenant": self.tenant} | kwargs
        return {"prompt": prompt, "documents": [to_evidence(d, i) for i, d in enumerate(docs)],
                "skills": list(skills), **args}

    # -- completion ---------------------------------------------------------------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        a = self.client.generate(**self._args(prompt, kwargs))
        return CompletionResponse(text=a.text, additional_kwargs=_extra(a))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self.client.stream(**self._args(prompt, kwargs))

        def gen() -> CompletionResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield CompletionResponse(text=text, delta="", additional_kwargs=_extra(stream.answer))

        return gen()

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        a = await self.client.agenerate(**self._args(prompt, kwargs))
        return CompletionResponse(text=a.text, additional_kwargs=_extra(a))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        stream = self.client.astream(**self._args(prompt, kwargs))

        async def gen() -> CompletionResponseAsyncGen:
            text = ""
            async for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
            yield CompletionResponse(text=text, delta="", additional_kwargs=_extra(stream.answer))

        return gen()

    # -- chat (native: the messages go to contextkit as chat turns) ------------------------------------

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        a = self.client.generate(**self._args(to_messages(messages), kwargs))
        return ChatResponse(message=ChatMessage(role="assistant", content=a.text), additional_kwargs=_extra(a))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self.client.stream(**self._args(to_messages(messages), kwargs))

        def gen() -> ChatResponseGen:
            text = ""
            for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta=delta)
            yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta="",
                               additional_kwargs=_extra(stream.answer))

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        a = await self.client.agenerate(**self._args(to_messages(messages), kwargs))
        return ChatResponse(message=ChatMessage(role="assistant", content=a.text), additional_kwargs=_extra(a))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        stream = self.client.astream(**self._args(to_messages(messages), kwargs))

        async def gen() -> ChatResponseAsyncGen:
            text = ""
            async for delta in stream:
                text += delta
                yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta=delta)
            yield ChatResponse(message=ChatMessage(role="assistant", content=text), delta="",
                               additional_kwargs=_extra(stream.answer))

        return gen()


class ContextKitReorderPostprocessor(BaseNodePostprocessor, Reordering):
    """Orders nodes so that the longest run this tenant already sent comes first (the Weaver; see
    ``contextkit.integrations.frameworks.langchain.ContextKitReorder``). Settings (``block_size``, ``tenant``,
    ``count_tokens``): ``contextkit.integrations.frameworks.adapter.Reordering``."""

    @classmethod
    def class_name(cls) -> str:
        return "ContextKitReorderPostprocessor"

    def _postprocess_nodes(self, nodes: list[NodeWithScore],
                           query_bundle: QueryBundle | None = None) -> list[NodeWithScore]:
        return [nodes[i] for i in self.reordered([to_evidence(n, i) for i, n in enumerate(nodes)])]


class EvidenceRetriever(BaseRetriever):
    """``search(query) -> [Evidence]`` (e.g. contextkit's faiss retriever) as a LlamaIndex retriever."""

    def __init__(self, search: Callable[[str], Sequence[Evidence]], **kw: Any):
        self._search = search
        super().__init__(**kw)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [NodeWithScore(node=TextNode(text=e.text, id_=e.id or content_id(e), metadata={"title": e.title}),
                              score=None) for e in self._search(query_bundle.query_str)]


class ContextKitQueryEngine(CustomQueryEngine):
    """Retrieve, postprocess, answer with the nodes as documents (``Response.metadata["contextkit"]``)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    retriever: BaseRetriever
    llm: ContextKitLLM
    node_postprocessors: list[BaseNodePostprocessor] = Field(default_factory=list)

    def custom_query(self, query_str: str) -> Response:
        nodes = self.retriever.retrieve(query_str)
        for p in self.node_postprocessors:
            nodes = p.postprocess_nodes(nodes, query_str=query_str)
        r = self.llm.complete(query_str, documents=nodes)
        return Response(r.text, source_nodes=nodes, metadata=r.additional_kwargs)

    async def acustom_query(self, query_str: str) -> Response:
        nodes = await self.retriever.aretrieve(query_str)
        for p in self.node_postprocessors:
            nodes = p.postprocess_nodes(nodes, query_str=query_str)
        r = await self.llm.acomplete(query_str, documents=nodes)
        return Response(r.text, source_nodes=nodes, metadata=r.additional_kwargs)
