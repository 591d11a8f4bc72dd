"""``bench synthesis``'s ``http`` path: the same workers and synthesizer as chats to ``contextkit serve``.

Per question, on a serve app over the bench's kit (in this process, on loopback, reached with the SDK's
HTTP client): each worker is a streamed chat (the worker instructions as its system message, "Note:" as
its user message, its passages as ``documents``) with ``contextkit.keep``; the synthesizer is a streamed
chat whose documents carry the notes as text (with ``transcripts``, each worker's passages and task first)
and whose ``contextkit.handles`` name the kept answers (serve reads each answer, and the passages its
worker read, from the worker's KV). Arms, in a rotating order, on the same prompt: ``text`` (``reuse``
full: the notes' text prefilled, what frameworks do today), the default policy reading the kept KV, and
``query_attention`` r = 0.2 beside it. TTFT is the client's (HTTP and all); the server is settled before
each timed request so the idle span compiles of one request do not land in the next one's time.

Fidelity: each arm's context is assembled again in process by serve's own steps (the planner, then
``synthesis.splice.splice`` on the app's kept answers) and the whole answer teacher-forced against the
text arm's (``spans.fidelity.score``, same engine and dtype). The keep's cost is the server's own
``contextkit_serve_keep_seconds``, per worker, against that worker's TTFT.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field

from contextkit.bench.answers import answered
from contextkit.bench.harness import Tick
from contextkit.core.generation import SamplingParams
from contextkit.core.policy import ReuseOptions
from contextkit.core.types import Evidence
from contextkit.spans.fidelity import score

KV = "kv default"
# a fixed ratio beside the default, as the in-process table has: where the path stands without the profile
FRONTIER = {"kv query_attention r=0.2": ReuseOptions(policy="query_attention", ratio=0.2, max_recompute=None)}


@dataclass
class HTTPRun:
    """What the http path measured: per (read, arm) metric lists, and per worker its TTFT and keep time."""

    per: dict[tuple[str, str], dict[str, list[float]]] = field(default_factory=dict)
    worker_ttft: list[float] = field(default_factory=list)
    keep_ms: list[float] = field(default_factory=list)
    reads: dict[str, int] = field(default_factory=dict)  # how named handles were read, by outcome


class HTTPPath:
    """A serve app over ``kit`` and an SDK client to it (``with``), and one question at a time (``question``)."""

    def __init__(self, kit, *, note_tokens: int, answer_tokens: int, workers: int):
        self.kit, self.note_tokens, self.answer_tokens, self.workers = kit, note_tokens, answer_tokens, workers
        self.run = HTTPRun()
        self._stack = ExitStack()

    def __enter__(self) -> HTTPPath:
        import contextkit
        from contextkit.integrations.edge.ratelimit import RateLimit
        from contextkit.integrations.launchers.inprocess import AppThread
        from contextkit.integrations.serve.app import ServeLimits, create_serve_app

        app = create_serve_app(self.kit, "bench", limits=ServeLimits(rate=RateLimit()))
        self.server = self._stack.enter_context(AppThread(app))
        self.serve = app.state.serve
        self.client = self._stack.enter_context(contextkit.connect(self.server.url))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _settled(self) -> None:
        self.serve.wait_settled(600)

    def _keep_seconds(self) -> float:
        return self.serve.metrics.registry.get_sample_value("contextkit_serve_keep_seconds_sum") or 0.0

    def _workers(self, worker: str, passages: list[Evidence]) -> list[tuple[int, str, str | None, list[Evidence]]]:
        """The workers, one after another: (worker number, note, handle, passages read) each."""
        out = []
        for w in range(self.workers):
            share = passages[w::self.workers]
            if not share:
                continue
            self._settled()
            before = self._keep_seconds()
            stream = self.client.stream([{"role": "system", "content": worker}, {"role": "user", "content": "Note:"}],
                                        share, max_tokens=self.note_tokens, keep=True, ordering="retrieval")
            for _ in stream:
                pass
            ans = stream.answer
            self.run.worker_ttft.append(ans.ttft_ms)
            self.run.keep_ms.append((self._keep_seconds() - before) * 1e3)
            out.append((w + 1, ans.text, ans.report.kept, share))
        return out

    @staticmethod
    def _documents(notes, transcripts: bool) -> list[Evidence]:
        docs: list[Evidence] = []
        for n, text, _, share in notes:
            if transcripts:
                docs += [Evidence(p.text, id=f"w{n}-d{j}", title=p.title) for j, p in enumerate(share)]
                docs.append(Evidence("Note:", id=f"w{n}-task", title=f"Task {n}"))
            docs.append(Evidence(text, id=f"w{n}-note", title=f"Note {n}"))
        return docs

    def question(self, *, qi: int, worker: str, synth: str, tail: str, passages: list[Evidence],
                 reads: list[str], gold: list[int] | None, tick: Tick) -> None:
        tick(f"http workers q{qi}")
        notes = [n for n in self._workers(worker, passages) if n[1].strip()]
        if not notes:
            return
        handles = [h for _, _, h, _ in notes if h]
        msgs = [{"role": "system", "content": synth}, {"role": "user", "content": tail.strip()}]
        for read in reads:
            docs = self._documents(notes, read == "transcripts")
            arms = {"text": False, KV: ReuseOptions(), **FRONTIER}
            names = list(arms)[qi % len(arms):] + list(arms)[: qi % len(arms)]
            ttft = {}
            for name in names:
                tick(f"http {read}: {name} q{qi}")
                self._settled()
                stream = self.client.stream(msgs, docs, max_tokens=self.answer_tokens, reuse=arms[name],
                                            ordering="retrieval", handles=handles)
                for _ in stream:
                    pass
                ttft[name] = stream.answer.ttft_ms
                if name == KV:
                    for _, r in stream.answer.report.handles:
                        self.run.reads[r] = self.run.reads.get(r, 0) + 1
            self._settled()
            self._fidelity(read, msgs, docs, handles, arms, ttft, gold)

    def _fidelity(self, read, msgs, docs, handles, arms, ttft, gold) -> None:
        """Each arm assembled again by serve's steps, its whole answer teacher-forced against the text arm's."""
        from contextkit.integrations.edge.parse import parse_chat
        from contextkit.sdk.http import body_of
        from contextkit.synthesis.splice import splice

        kit, params = self.kit, SamplingParams(max_new_tokens=self.answer_tokens)
        kvs, reports = {}, {}
        for name, reuse in arms.items():
            call = self.client.call(msgs, docs, max_tokens=self.answer_tokens, reuse=reuse, ordering="retrieval",
                                    handles=handles)
            body = json.loads(json.dumps(body_of(call, None, stream=False)))  # as the server reads it
            _, req = parse_chat(body, lambda _t: self.serve.tenancy.resolve(
                self.serve.tenancy.authenticate(None), None), allow_reuse=True)
            plan, provided, _ = splice(kit.plan(req), handles, self.serve.kept.store, req.tenant,
                                       spans=kit.spans)
            asm = kit.spans.assemble(plan, extra_capacity=self.answer_tokens + 1, provided=provided)
            kvs[name], _ = answered(kit.engine, kit.tokenizer, plan.ids, asm.cache, asm.logits, params)
            reports[name] = asm.report
        whole = score(kvs, same_dtype="text", fp32=None, gold=gold)
        for name in arms:
            m = self.run.per.setdefault((read, name), {})
            m.setdefault("ttft", []).append(ttft[name])
            for key in ("tf_agreement", "answer_kl"):
                m.setdefault(key, []).append(whole[name][key])
            if whole[name]["gold_logprob_delta"] is not None:
                m.setdefault("gold", []).append(whole[name]["gold_logprob_delta"])
            m.setdefault("escalated", []).append(float(reports[name].escalated))
            m.setdefault("recomputed", []).append(reports[name].recomputed_tokens)
            m.setdefault("context", []).append(reports[name].context_tokens)
