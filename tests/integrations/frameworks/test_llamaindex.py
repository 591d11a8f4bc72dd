"""The LlamaIndex adapters with the real llama-index-core (and OpenAILike for the drop-in path), end to
end against contextkit serve, in process and against the proxy in front of vLLM."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

pytest.importorskip("llama_index.core", reason="the llamaindex extra: pip install 'contextkit[llamaindex]'")

from llama_index.core.llms import ChatMessage  # noqa: E402
from llama_index.core.schema import NodeWithScore, TextNode  # noqa: E402

import contextkit  # noqa: E402
from contextkit.core.errors import AuthenticationError  # noqa: E402
from contextkit.core.types import Evidence  # noqa: E402
from contextkit.integrations.frameworks.llamaindex import (  # noqa: E402
    ContextKitLLM,
    ContextKitQueryEngine,
    ContextKitReorderPostprocessor,
    EvidenceRetriever,
)  # fmt: skip


@pytest.fixture(scope="module")
def nodes(repo):
    ex = json.loads((repo / "examples" / "question.json").read_text())
    return ex["question"], [NodeWithScore(node=TextNode(text=d["text"], id_=f"n{i}",
                                                        metadata={"title": d.get("title")}),
                                          score=1.0) for i, d in enumerate(ex["documents"])]


def test_llm_complete_stream_chat_against_serve(keyed_serve, nodes):
    url, key, _ = keyed_serve
    question, ns = nodes
    llm = ContextKitLLM(base_url=url, api_key=key, max_tokens=6)
    assert llm.metadata.is_chat_model
    r = llm.complete(question, documents=ns)
    ck = r.additional_kwargs["contextkit"]
    assert ck["path"] == "kv" and sorted(ck["order"]) == sorted(n.node.node_id for n in ns) and r.text
    parts = list(llm.stream_complete(question, documents=ns))
    assert parts[-1].text == "".join(p.delta for p in parts) and parts[-1].additional_kwargs["contextkit"]
    chat = llm.chat([ChatMessage(role="system", content="Answer briefly."), ChatMessage(role="user", content=question)],
                    documents=ns)
    assert chat.message.content and chat.additional_kwargs["contextkit"]["path"] == "kv"
    assert asyncio.run(llm.acomplete(question, documents=ns)).additional_kwargs["cached_tokens"] > 0

    async def astream():
        gen = await llm.astream_chat([ChatMessage(role="user", content=question)], documents=ns)
        return [p async for p in gen]

    out = asyncio.run(astream())
    assert out[-1].message.content == "".join(p.delta for p in out)


def test_query_engine_with_reorder_postprocessor_in_process(keyed_serve, nodes):
    _, _, kit = keyed_serve
    question, ns = nodes
    evidence = [Evidence(n.node.get_content(), id=n.node.node_id, title=n.node.metadata["title"]) for n in ns]
    post = ContextKitReorderPostprocessor(block_size=1, tenant="li")
    engine = ContextKitQueryEngine(retriever=EvidenceRetriever(lambda q: evidence),
                                   llm=ContextKitLLM(client=contextkit.connect(kit=kit), max_tokens=4),
                                   node_postprocessors=[post])
    resp = engine.query(question)
    assert resp.response and resp.metadata["contextkit"]["path"] == "kv"
    assert [n.node.node_id for n in resp.source_nodes] == list(resp.metadata["contextkit"]["order"])
    first = [n.node.node_id for n in post.postprocess_nodes(ns, query_str=question)]
    assert [n.node.node_id for n in post.postprocess_nodes(ns[::-1], query_str=question)] == first
    assert asyncio.run(engine.aquery(question)).metadata["contextkit"]["path"] == "kv"


def test_llm_through_the_proxy_and_the_openailike_drop_in(open_proxy, nodes):
    question, ns = nodes
    llm = ContextKitLLM(base_url=open_proxy, max_tokens=4, tenant="li-proxy")
    one, two = llm.complete(question, documents=ns), llm.complete(question, documents=ns[::-1])
    assert one.additional_kwargs["contextkit"]["path"] == "prompt"
    assert two.additional_kwargs["contextkit"]["order"] == one.additional_kwargs["contextkit"]["order"]
    assert two.additional_kwargs["cached_tokens"] > 0

    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    body = [{"id": n.node.node_id, "title": n.node.metadata["title"], "text": n.node.get_content()} for n in ns]

    def make(extra):
        return openai_like.OpenAILike(api_base=open_proxy + "/v1", api_key="none", model="smol", is_chat_model=True,
                                      context_window=8192, max_tokens=2, temperature=0, max_retries=0,
                                      additional_kwargs=extra)

    bare = make({}).chat([ChatMessage(role="user", content=question)])
    rag = make({"extra_body": {"documents": body}}).chat([ChatMessage(role="user", content=question)])
    # what was sent: the proxy rendered the documents into the prompt vLLM counted
    assert rag.raw.usage.prompt_tokens > bare.raw.usage.prompt_tokens + 50


def test_bad_input_and_failures(keyed_serve, nodes):
    url, _, _ = keyed_serve
    question, ns = nodes
    with pytest.raises(ValueError, match="client=contextkit.connect"):
        ContextKitLLM()
    with pytest.raises(AuthenticationError, match="401"):
        ContextKitLLM(base_url=url, api_key="wrong", max_tokens=2).complete(question, documents=ns)
    ok = ContextKitLLM(base_url=url, api_key=keyed_serve[1], max_tokens=2)
    with pytest.raises(ValueError, match="no text"):
        ok.complete(question, documents=[TextNode(text="  ")])
    with pytest.raises(ValueError, match="title"):
        ok.complete(question, documents=[TextNode(text="x", metadata={"title": 5})])


def test_importing_without_the_extra_says_what_to_install():
    code = ("import sys; sys.modules['llama_index.core'] = None; sys.modules['llama_index'] = None\n"
            "import contextkit.integrations.frameworks.llamaindex")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "pip install 'contextkit[llamaindex]'" in proc.stderr
