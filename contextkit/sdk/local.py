"""The in-process transport: calls run on a ``ContextKit`` (the built-in engine) in this process, and
``fork``/``join`` share worker branches' KV. Needs the ``local`` extra (torch); ``connect(url)`` never
imports this module."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from contextkit.core.errors import EmptyInputError
from contextkit.core.generation import SamplingParams
from contextkit.core.planner import ChatRequest
from contextkit.core.policy import ReuseOptions
from contextkit.core.prompt import render_document
from contextkit.core.tenant import Tenant
from contextkit.core.types import Skill
from contextkit.kit import ContextKit, KitStream
from contextkit.sdk.session import Client, athread, evidence
from contextkit.sdk.shapes import Answer, Call, ReuseSummary


class LocalTransport:
    """Calls on a ``ContextKit`` in this process (one engine: calls run one at a time)."""

    name = "local"

    def __init__(self, kit: ContextKit):
        self.kit = kit
        self.skills = kit.skills
        self._lock = threading.Lock()  # the engine runs one request at a time

    def skill(self, name: str) -> Skill:
        return self.kit.skills.get(name)

    def _request(self, call: Call) -> ChatRequest:
        if call.reuse is False:
            reuse = None
        elif call.reuse is None:
            reuse = ReuseOptions() if call.documents or call.skills else None
        else:
            reuse = call.reuse
        return ChatRequest(call.messages, call.documents, call.skills, Tenant.of(call.tenant), call.ordering,
                           False, reuse, call.max_tokens, documents_at=call.documents_at)

    @staticmethod
    def params(call: Call) -> SamplingParams:
        return SamplingParams(max_new_tokens=call.max_tokens, temperature=call.temperature, top_p=call.top_p,
                              seed=call.seed, stop=call.stop)

    def stream(self, call: Call) -> Iterator[str | Answer]:
        # the lock is held per engine step, never across a yield: a caller that stops reading a stream
        # (or reads two at once) blocks nobody; each stream has its own KV cache, so steps may interleave
        t0 = time.perf_counter()
        with self._lock:
            plan = self.kit.plan(self._request(call))
            ks = self.kit.run(plan, self.params(call))
            steps = iter(ks)
        first = None
        while True:
            with self._lock:
                delta = next(steps, None)
            if delta is None:
                break
            if first is None:
                first = (time.perf_counter() - t0) * 1e3
            yield delta
        total = (time.perf_counter() - t0) * 1e3
        yield answer_of(ks, total if first is None else first, total, self.kit.config.model)

    def complete(self, call: Call) -> Answer:
        *_, last = self.stream(call)
        return last

    async def acomplete(self, call: Call) -> Answer:
        last = None
        async for item in athread(self.stream(call)):
            last = item
        return last

    def astream(self, call: Call) -> AsyncIterator[str | Answer]:
        return athread(self.stream(call))

    def fork(self, client: Client, prefix: str, prompts: Sequence[str],
             documents: Sequence[Sequence[Any]] = (), max_tokens: int = 64, tenant: str | None = None) -> Team:
        """Worker branches over one shared prefix (its KV computed once, shared, not copied): branch i
        reads ``documents[i]`` (if given) then ``prompts[i]`` and writes up to ``max_tokens`` (greedy)."""
        from contextkit.synthesis.parallel import fork

        if not prompts:
            raise EmptyInputError("fork needs at least one branch prompt")
        tok = self.kit.tokenizer
        prefix_ids = tok.encode(prefix, add_special_tokens=True)
        docs = list(documents) + [()] * (len(prompts) - len(documents))
        branch_ids = [tok.encode("".join(render_document(evidence(d)) for d in ds) + p) for ds, p in zip(docs, prompts)]
        with self._lock:
            f = fork(self.kit.spans, tok, prefix_ids, branch_ids, SamplingParams(max_new_tokens=max_tokens),
                     tenant=Tenant.of(tenant))
        return Team(self, f)

    def close(self) -> None:
        self.kit.close()


class Team:
    """Forked worker branches (``branches``: text, tokens, error each) and the synthesizer that reads
    their KV (``join``) or, for comparison, their text (``join_text``)."""

    def __init__(self, transport: LocalTransport, fork):
        self.transport, self.fork = transport, fork
        self.branches = fork.branches

    def _join(self, head: str, tail: str, options: ReuseOptions | None, max_tokens: int, label: str,
              transcripts: bool = False) -> Answer:
        from contextkit.engine.generate import Stream
        from contextkit.synthesis.parallel import join, join_text

        kit, tok = self.transport.kit, self.transport.kit.tokenizer
        t0 = time.perf_counter()
        head_ids, tail_ids = tok.encode(head, add_special_tokens=True), tok.encode(tail)
        labels = [tok.encode(label.format(i=b.index + 1)) for b in self.branches] if label else []
        with self.transport._lock:
            if options is None:
                asm, _, plan = join_text(self.fork, head_ids, tail_ids, labels, max_tokens + 1, transcripts)
            else:
                asm, _, plan = join(self.fork, head_ids, tail_ids, labels, options, max_tokens + 1, transcripts)
            stream = Stream(kit.engine, tok, plan.ids, SamplingParams(max_new_tokens=max_tokens), cache=asm.cache,
                            first_logits=asm.logits)
            ks = KitStream(stream, plan, asm.report)
            first = None
            for _ in ks:
                first = first or (time.perf_counter() - t0) * 1e3
        total = (time.perf_counter() - t0) * 1e3
        return answer_of(ks, first or total, total, kit.config.model)

    def join(self, head: str, tail: str = "\n\nAnswer:", reuse: ReuseOptions | None = None, max_tokens: int = 64,
             label: str = "\nNote {i}:", transcripts: bool = False) -> Answer:
        """The synthesizer: ``head``, each successful branch's output under ``label`` read from its KV
        (re-positioned, recomputed per ``reuse``: default policy), then ``tail``; generates the answer.
        ``transcripts``: each branch's prompt (what it read) comes before its output."""
        return self._join(head, tail, reuse or ReuseOptions(), max_tokens, label, transcripts)

    def join_text(self, head: str, tail: str = "\n\nAnswer:", max_tokens: int = 64,
                  label: str = "\nNote {i}:", transcripts: bool = False) -> Answer:
        """The same synthesizer prompt with the branches' text prefilled in full (the baseline)."""
        return self._join(head, tail, None, max_tokens, label, transcripts)


def answer_of(ks: KitStream, ttft_ms: float, total_ms: float, model: Any = None) -> Answer:
    gen, plan, rep = ks.result, ks.plan, ks.report
    assert gen is not None
    n = len(ks.prompt_ids)
    if rep is None:
        report = ReuseSummary("prefill", n, prefilled_tokens=n, order=plan.document_ids, reordered=plan.reordered)
    else:
        report = ReuseSummary("kv", n, rep.cached_tokens, rep.reused_tokens, rep.recomputed_tokens,
                              rep.prefilled_tokens, rep.compiled_tokens, plan.document_ids, plan.reordered, rep.policy,
                              detail=rep)
    return Answer(gen.text, gen.finish_reason, n, len(gen.token_ids), report, ttft_ms, total_ms,
                  None if model is None else str(model))
