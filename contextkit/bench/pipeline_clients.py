"""The pipelines ``bench pipelines`` compares: each framework's client (stock OpenAI ones straight to vLLM,
contextkit's adapters through the proxy or on the built-in engine), built once per run, and one request
through one pipeline, timed outside the framework (TTFT, answer, our adapter's own cost)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from contextkit.bench.harness import median
from contextkit.core.prompt import DEFAULT_SYSTEM, render_document
from contextkit.core.types import Evidence


def _stuffed(question: str, docs) -> str:
    """What a framework's stuff-documents prompt sends: the passages in retrieval order, then the question."""
    return "".join(render_document(Evidence(d.text, id=d.id, title=d.title)) for d in docs) + f"Question: {question}"


def _timed_stream(chunks, text_of, marked=lambda c: True) -> tuple[float, str, object]:
    """(ms to the first non-empty text, the whole text, (the last chunk ``marked`` holds, total ms)) of a
    framework stream."""
    t0 = time.perf_counter()
    first, parts, last = None, [], None
    for c in chunks:
        t = text_of(c)
        if t and first is None:
            first = (time.perf_counter() - t0) * 1e3
        parts.append(t or "")
        last = c if marked(c) else last
    total = (time.perf_counter() - t0) * 1e3
    return (first if first is not None else total), "".join(parts), (last, total)


def _adapter_ms(name: str, question: str, retrieved, llm, reps: int = 20) -> float:
    """Median ms our adapter code spends on one call's own inputs and output: framework messages and
    documents to the SDK call, and the SDK answer back to the framework's response (no I/O)."""
    from langchain_core.messages import HumanMessage

    from contextkit.sdk.shapes import Answer, ReuseSummary

    answer = Answer("an answer of a few words", "stop", 1400, 8, ReuseSummary("kv", 1400, 1200, 1300, 40, 60),
                    100.0, 200.0, "smol", "id")
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if name == "llamaindex with":
            args = llm._args(question, {"documents": retrieved})
            llm.client.call(**args)
            _ = llm_extra(answer)
        else:
            args = llm._call_args([HumanMessage(question)], None, {"documents": retrieved})
            llm.client.call(**args)
            llm._result(answer)
        ms.append((time.perf_counter() - t0) * 1e3)
    return median(ms)


def llm_extra(answer):
    from contextkit.integrations.frameworks.llamaindex import CompletionResponse, _extra

    return CompletionResponse(text=answer.text, additional_kwargs=_extra(answer))


def _ours(c) -> bool:
    """The chunk our chat model ends with (LangChain may add an empty one after it)."""
    return "total_ms" in (c.response_metadata or {})


def _lc_text(c) -> str:
    return c.content if isinstance(c.content, str) else ""


@dataclass(frozen=True)
class Clients:
    """Every pipeline's client, built once per run, each under its own cache namespace."""

    lc_plain: Any
    lc_ck: Any
    lc_ret: Any
    li_plain: Any
    li_ck: Any
    kv_full: Any
    kv_reuse: Any

    @classmethod
    def build(cls, upstream: str, proxy: str, model: str, local, salt: dict[str, str], max_tokens: int) -> Clients:
        from langchain_openai import ChatOpenAI
        from llama_index.llms.openai_like import OpenAILike

        from contextkit.integrations.frameworks.langchain import ChatContextKit
        from contextkit.integrations.frameworks.llamaindex import ContextKitLLM

        return cls(
            lc_plain=ChatOpenAI(base_url=upstream + "/v1", api_key="none", model=model, max_tokens=max_tokens,
                                temperature=0, max_retries=0, extra_body={"cache_salt": salt["langchain without"]}),
            lc_ck=ChatContextKit(base_url=proxy, max_tokens=max_tokens, tenant=salt["langchain with"]),
            lc_ret=ChatContextKit(base_url=proxy, max_tokens=max_tokens,
                                  tenant=salt["langchain with (retrieval order)"]),
            li_plain=OpenAILike(api_base=upstream + "/v1", api_key="none", model=model, is_chat_model=True,
                                context_window=8192, max_tokens=max_tokens, temperature=0, max_retries=0,
                                additional_kwargs={"extra_body": {"cache_salt": salt["llamaindex without"]}}),
            li_ck=ContextKitLLM(base_url=proxy, max_tokens=max_tokens, tenant=salt["llamaindex with"]),
            kv_full=ChatContextKit(client=local, max_tokens=max_tokens, reuse=False,
                                   tenant=salt["kv without (full prefill)"]),
            kv_reuse=ChatContextKit(client=local, max_tokens=max_tokens, tenant=salt["kv with (span reuse)"]),
        )

    def warm_up(self) -> None:
        """Each client's first call, not measured (connections, the proxy's first tokenizer use)."""
        warm = [Evidence("A warm-up passage.", id="warm-up")]
        self.lc_plain.invoke("Say hi.")
        self.li_plain.complete("Say hi.")
        for llm in (self.lc_ck, self.lc_ret, self.kv_full, self.kv_reuse):
            llm.invoke("Say hi.", documents=warm)
        self.li_ck.complete("Say hi.", documents=warm)


def run_one(c: Clients, name: str, req) -> dict:
    """One request through the pipeline ``name``: TTFT, answer text, and what our adapter reported."""
    from langchain_core.messages import HumanMessage, SystemMessage
    from llama_index.core.llms import ChatMessage

    from contextkit.integrations.frameworks.langchain import EvidenceRetriever
    from contextkit.integrations.frameworks.llamaindex import (
        EvidenceRetriever as NodeRetriever,
    )

    docs, system = req.documents, DEFAULT_SYSTEM
    evidence = [Evidence(d.text, id=d.id, title=d.title) for d in docs]
    if name.startswith("llamaindex"):
        retrieved = NodeRetriever(lambda q: evidence).retrieve(req.question)
    else:  # LangChain's retriever for the LangChain and the KV-path pipelines
        retrieved = EvidenceRetriever(search=lambda q: evidence).invoke(req.question)
    out: dict = {}
    if name == "langchain without":
        ttft, text, _ = _timed_stream(c.lc_plain.stream([SystemMessage(system),
                                                         HumanMessage(_stuffed(req.question, docs))]),
                                      _lc_text)
    elif name.startswith("langchain with"):
        kw = {"ordering": "retrieval"} if "retrieval order" in name else {}
        llm = c.lc_ck if not kw else c.lc_ret
        ttft, text, (last, total) = _timed_stream(llm.stream(req.question, documents=retrieved, **kw), _lc_text, _ours)
        out = {"meta": last.response_metadata, "overhead": total - last.response_metadata["total_ms"]}
    elif name == "llamaindex without":
        msgs = [ChatMessage(role="system", content=system),
                ChatMessage(role="user", content=_stuffed(req.question, docs))]
        ttft, text, _ = _timed_stream(c.li_plain.stream_chat(msgs), lambda ch: ch.delta)
    elif name == "llamaindex with":
        ttft, text, (last, total) = _timed_stream(c.li_ck.stream_complete(req.question, documents=retrieved),
                                                  lambda ch: ch.delta)
        meta = last.additional_kwargs
        out = {"meta": {"contextkit": meta["contextkit"]}, "overhead": total - meta["total_ms"]}
    else:
        llm = c.kv_full if "without" in name else c.kv_reuse
        ttft, text, (last, total) = _timed_stream(llm.stream(req.question, documents=retrieved), _lc_text, _ours)
        out = {"meta": last.response_metadata, "overhead": total - last.response_metadata["total_ms"]}
    if name in ("langchain with", "llamaindex with", "kv with (span reuse)"):
        adapter = {"langchain with": c.lc_ck, "llamaindex with": c.li_ck, "kv with (span reuse)": c.kv_reuse}[name]
        out["adapter"] = _adapter_ms(name, req.question, retrieved, adapter)
    return {"ttft": ttft, "text": text, **out}
