"""The LangChain adapters with the real langchain-core (and langchain-openai for the drop-in path),
end to end against contextkit serve and against the proxy in front of vLLM."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

pytest.importorskip("langchain_core", reason="the langchain extra: pip install 'contextkit[langchain]'")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402

import contextkit  # noqa: E402
from contextkit.core.errors import AuthenticationError, UpstreamError  # noqa: E402
from contextkit.core.types import Evidence  # noqa: E402
from contextkit.integrations.frameworks.langchain import ChatContextKit, ContextKitReorder, EvidenceRetriever  # noqa: E402
from contextkit.integrations.launchers.process import free_port  # noqa: E402


@pytest.fixture(scope="module")
def docs(repo):
    ex = json.loads((repo / "examples" / "question.json").read_text())
    return ex["question"], [Document(page_content=d["text"], id=f"d{i}", metadata={"title": d.get("title")})
                            for i, d in enumerate(ex["documents"])]


@pytest.fixture(scope="module")
def serve_llm(keyed_serve):
    url, key, _ = keyed_serve
    return ChatContextKit(base_url=url, api_key=key, max_tokens=6)


def test_chat_model_sends_documents_to_serve_and_reports_reuse(serve_llm, docs):
    question, documents = docs
    msg = serve_llm.invoke([SystemMessage("Answer briefly."), HumanMessage(question)], documents=documents)
    meta = msg.response_metadata["contextkit"]
    assert meta["path"] == "kv" and sorted(meta["order"]) == sorted(d.id for d in documents)
    assert msg.usage_metadata["input_tokens"] == meta["prompt_tokens"] and msg.content
    again = serve_llm.invoke(question, documents=documents[::-1])
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0  # the documents' spans were hits
    chunks = list(serve_llm.stream(question, documents=documents))
    streamed = "".join(c.content for c in chunks)
    last = [c for c in chunks if c.response_metadata.get("contextkit")]
    assert streamed and last and last[-1].usage_metadata["output_tokens"] >= 1
    amsg = asyncio.run(serve_llm.ainvoke(question, documents=documents))
    assert amsg.response_metadata["contextkit"]["path"] == "kv"

    async def astream():
        return [c.content async for c in serve_llm.astream(question, documents=documents)]

    assert "".join(asyncio.run(astream()))


def test_an_lcel_rag_chain_with_the_reorder_compressor(keyed_serve, docs):
    """retriever -> compressor (ordering for reuse) -> prompt -> chat model with the documents attached."""
    _, _, kit = keyed_serve
    question, documents = docs
    evidence = [Evidence(d.page_content, id=d.id, title=d.metadata["title"]) for d in documents]
    retriever = EvidenceRetriever(search=lambda q: evidence)
    reorder = ContextKitReorder(block_size=1, tenant="lc")
    llm = ChatContextKit(client=contextkit.connect(kit=kit), max_tokens=4)
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    chain = (
        RunnableLambda(lambda q: {"question": q, "docs": reorder.compress_documents(retriever.invoke(q), q)})
        | RunnableLambda(lambda x: llm.invoke(prompt.invoke({"question": x["question"]}), documents=x["docs"]))
    )
    out = chain.invoke(question)
    assert out.response_metadata["contextkit"]["path"] == "kv" and out.content
    # the compressor keeps what this tenant served first: a later retrieval in another order is restored
    first = [d.id for d in reorder.compress_documents(documents, question)]
    assert [d.id for d in reorder.compress_documents(documents[::-1], question)] == first
    assert len(reorder.compress_documents(documents + documents[:1], question)) == len(documents)  # de-duplicated
    assert asyncio.run(reorder.acompress_documents(documents[::-1], question))[0].id == first[0]


def test_chat_model_through_the_proxy_orders_for_vllms_prefix_cache(open_proxy, docs):
    question, documents = docs
    llm = ChatContextKit(base_url=open_proxy, max_tokens=4, tenant="lc-proxy")
    one = llm.invoke(question, documents=documents)
    two = llm.invoke(question, documents=documents[::-1])
    m1, m2 = one.response_metadata["contextkit"], two.response_metadata["contextkit"]
    assert m1["path"] == m2["path"] == "prompt"
    assert m2["order"] == m1["order"] and m2["reordered"]  # put back in the order vLLM holds
    assert m2["cached_tokens"] > 0


def test_chat_openai_drop_in_with_documents_in_extra_body(open_proxy, docs):
    langchain_openai = pytest.importorskip("langchain_openai")
    question, documents = docs
    body = [{"id": d.id, "title": d.metadata["title"], "text": d.page_content} for d in documents]
    plain = langchain_openai.ChatOpenAI(base_url=open_proxy + "/v1", api_key="none", model="smol", max_tokens=2,
                                        temperature=0, max_retries=0)
    with_docs = plain.bind(extra_body={"documents": body})
    bare, rag = plain.invoke(question), with_docs.invoke(question)
    # what was sent: the proxy rendered the documents into the prompt vLLM counted
    assert rag.usage_metadata["input_tokens"] > bare.usage_metadata["input_tokens"] + 50
    assert rag.response_metadata.get("finish_reason") in ("stop", "length")


def test_bad_input_and_failures_raise_clear_errors(keyed_serve, docs):
    url, _, _ = keyed_serve
    question, documents = docs
    with pytest.raises(ValueError, match="client=contextkit.connect"):
        ChatContextKit()
    llm = ChatContextKit(base_url=url, api_key="wrong", max_tokens=2)
    with pytest.raises(AuthenticationError, match="401"):
        llm.invoke(question, documents=documents)
    down = ChatContextKit(base_url=f"http://127.0.0.1:{free_port()}", max_tokens=2, timeout_s=5)
    with pytest.raises(UpstreamError, match="cannot reach"):
        down.invoke(question, documents=documents)
    ok = ChatContextKit(base_url=url, api_key=keyed_serve[1], max_tokens=2)
    with pytest.raises(ValueError, match="no page_content"):
        ok.invoke(question, documents=[Document(page_content=" ")])
    with pytest.raises(ValueError, match="title"):
        ok.invoke(question, documents=[Document(page_content="x", metadata={"title": 3})])
    # metadata is not sent: a value JSON cannot hold is fine
    odd = Document(page_content=documents[0].page_content, metadata={"title": "t", "handle": object()})
    assert ok.invoke(question, documents=[odd]).content is not None


def test_importing_without_the_extra_says_what_to_install():
    code = ("import sys; sys.modules['langchain_core'] = None\n"
            "import contextkit.integrations.frameworks.langchain")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "pip install 'contextkit[langchain]'" in proc.stderr
