"""The ContextKit facade: the config, the model, its tokenizer, the planner and the span cache.

Every request goes through the one planner (``contextkit.core.planner``), ordered by the kit's Weaver,
then runs on the built-in engine: a plain prefill of the plan's tokens, or (with ``reuse``) the KV path,
where documents are position-free spans compiled once and re-positioned into later requests.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Concatenate, ParamSpec

import torch

from contextkit.core.config import ContextKitConfig
from contextkit.core.generation import Generation, SamplingParams
from contextkit.core.models import Progress, resolve_model_dir
from contextkit.core.plan import RequestPlan, ReuseReport
from contextkit.core.planner import ChatRequest, Ordering, Planner
from contextkit.core.policy import ReuseOptions
from contextkit.core.tenancy import derive
from contextkit.core.tenant import Tenant
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message, Skill
from contextkit.engine.generate import Stream
from contextkit.engine.model import Engine
from contextkit.kernels.rerotate import Rerotator
from contextkit.kvstore.tiered import TieredStore, build_store
from contextkit.ordering.weaver import Weaver
from contextkit.spans.assemble import SpanCache
from contextkit.spans.calibration import find_profile
from contextkit.spans.store import CompiledSpan, KVSpanStore
from contextkit.synthesis.skills import SkillLibrary

P = ParamSpec("P")


class KitStream:
    """Iterate for text deltas; afterwards ``result`` holds the Generation (with the reuse report).

    ``plan`` is what ran; ``report`` says what span reuse did (None for a plain prefill).
    """

    def __init__(self, stream: Stream, plan: RequestPlan, report: ReuseReport | None,
                 after: Callable[[], object] | None = None):
        self._stream, self.plan, self.report = stream, plan, report
        self._after = after  # runs once the answer is complete (compiles the spans it computed in context)
        self.result: Generation | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self._stream.prompt_ids

    @property
    def generation(self) -> Stream:
        """The engine's stream: its cache holds the prompt's and the answer's KV (``synthesis.handles``)."""
        return self._stream

    def __iter__(self) -> Iterator[str]:
        yield from self._stream
        gen = self._stream.result
        assert gen is not None
        if self.report is not None:  # time to first token includes assembling the spans
            gen = dataclasses.replace(gen, prefill_ms=gen.prefill_ms + self.report.total_ms, reuse=self.report)
        self.result = gen
        if self._after is not None:
            self._after()

    def then(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the answer is complete (after what is already due then), on the thread that
        iterates: before the last delta has been handed over, so before any answer is sent."""
        prev = self._after
        self._after = fn if prev is None else (lambda: (prev(), fn()))

    def finish(self) -> Generation:
        """Run to the end (discarding deltas) and return the Generation."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def _planned(
    request: Callable[Concatenate[ContextKit, P], ChatRequest], doc: str,
) -> Callable[Concatenate[ContextKit, P], KitStream]:
    """A method that takes ``request``'s arguments, plans the request and starts it (``run`` with its
    ``params``): one signature for both, as ``_finished``."""
    signature = inspect.signature(request)

    def stream(self: ContextKit, *args: P.args, **kwargs: P.kwargs) -> KitStream:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return self.run(self.plan(request(self, *args, **kwargs)), bound.arguments["params"])

    stream.__doc__ = doc
    stream.__signature__ = signature.replace(return_annotation="KitStream")
    stream.__qualname__ = "ContextKit.stream"
    return stream


def _finished(
    stream: Callable[Concatenate[ContextKit, P], KitStream], doc: str,
) -> Callable[Concatenate[ContextKit, P], Generation]:
    """A method that takes ``stream``'s arguments and returns its finished Generation: one signature for both
    (``help`` and ``inspect`` show it; type checkers follow ``P``)."""

    def generate(self: ContextKit, *args: P.args, **kwargs: P.kwargs) -> Generation:
        return stream(self, *args, **kwargs).finish()

    generate.__doc__ = doc
    generate.__signature__ = inspect.signature(stream).replace(return_annotation="Generation")
    generate.__qualname__ = "ContextKit.generate"
    return generate


class ContextKit:
    """Answer questions over evidence on the built-in engine.

    Example:
        >>> kit = ContextKit(ContextKitConfig())
        >>> kit.generate("Who wrote it?", [Evidence("Dune was written by Frank Herbert.")]).text
    """

    def __init__(self, config: ContextKitConfig | None = None, progress: Progress | None = None):
        self.config = config or ContextKitConfig()
        if self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        self.model_dir = resolve_model_dir(self.config.model, self.config.cache_dir, progress)
        self.engine = Engine.from_dir(self.model_dir, self.config.dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        self.planner = Planner(self.tokenizer, context_limit=self.engine.spec.max_positions)
        # the order a tenant's documents were served in; the built-in engine has no block hashing
        self.weaver = Weaver(block_size=1)
        # documents seen by this kit keep their KV here, reused at any position by later requests
        secret = self.config.load_secret()
        self.spans = SpanCache(
            self.engine,
            store=KVSpanStore(build_store(self.config.kvstore, derive(secret, "kv-mac"), derive(secret, "kv-enc"))),
            rerotator=Rerotator("auto", build_dir=self.config.cache_dir / "kernels"),
            tokenizer_fingerprint=self.tokenizer.fingerprint,
            profile=find_profile(self.model_dir, model_digest=self.engine.fingerprint.digest, dtype=self.config.dtype,
                                 explicit=self.config.calibration),
        )
        # skills registered here compile into the same span cache (kit.skills.register(folder))
        self.skills = SkillLibrary(self.planner, self.spans)

    def close(self) -> None:
        """Close the KV store's tiers (LMCache runs threads that would otherwise keep the process alive)."""
        self.spans.store.kv.close()

    # What a server over the kit needs, so it never reaches into the kit's parts (issue 27).

    @property
    def max_positions(self) -> int:
        """The model's context in tokens: the longest prompt plus answer the engine takes."""
        return self.engine.spec.max_positions

    @property
    def kv_store(self) -> TieredStore:
        """The tiers span KV lives in (their ``stats()`` are what a server exports as metrics)."""
        return self.spans.store.kv

    def tokenize(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """``text`` as the model's token ids."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def plan_prompt(self, prompt: str | Sequence[int], tenant: Tenant | str = "",
                    max_new_tokens: int = 16) -> RequestPlan:
        """A completion prompt (text, tokenized with the model's special tokens, or token ids) as a plan
        for ``run``: no documents, no reuse, a plain prefill (422 if empty, out of vocabulary or too long)."""
        return self.planner.plan_prompt(prompt, Tenant.of(tenant), max_new_tokens=max_new_tokens)

    def compile_pending_spans(self, limit: int | None = None) -> int:
        """Do up to ``limit`` (None: all) units of the span work requests run with ``compile_after=False``
        left: compile the documents they computed in context position-free, and store exact prefix
        links. Returns the units done (0: nothing was left). Runs the engine: call it where requests run."""
        return self.spans.compile_pending(limit)

    def __enter__(self) -> ContextKit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(
        self,
        question: str | Sequence[Message | dict],
        documents: Sequence[Evidence | str] = (),
        system: str | None = None,
        params: SamplingParams = SamplingParams(),
        reuse: ReuseOptions | None = None,
        tenant: Tenant | str = "",
        ordering: Ordering = "weaver",
        skills: Sequence[Skill | str] = (),
    ) -> ChatRequest:
        """The request the planner sees: a question (with ``system``: None = the default RAG prompt,
        "" = none) or a whole conversation as chat messages (every turn is kept). ``skills``: skills (or
        names of skills registered in ``self.skills``) rendered after the system prompt."""
        chosen = tuple(s if isinstance(s, Skill) else self.skills.get(s) for s in skills)
        common = dict(tenant=Tenant.of(tenant), ordering=ordering, reuse=reuse, max_new_tokens=params.max_new_tokens,
                      skills=chosen)
        if isinstance(question, str):
            return ChatRequest.ask(question, documents, system, **common)
        msgs = tuple(m if isinstance(m, Message) else Message(m["role"], m.get("content") or "") for m in question)
        docs = tuple(d if isinstance(d, Evidence) else Evidence(text=d) for d in documents)
        return ChatRequest(msgs, docs, **common)

    def plan(self, request: ChatRequest) -> RequestPlan:
        """The request's plan, ordered for the tenant by the kit's Weaver (nothing recorded yet)."""
        return self.planner.plan(request, self.weaver)

    def run(self, plan: RequestPlan, params: SamplingParams = SamplingParams(),
            compile_after: bool = True, provided: dict[int, CompiledSpan] | None = None) -> KitStream:
        """Start ``plan``: a plain prefill of its tokens, or the KV path when ``plan.options`` allows
        reuse. The served order is recorded for the tenant once the prompt is in place.

        On the KV path, documents with no KV yet are computed in the request's context (exact after an
        exact prefix, and kept as prefix links); with ``compile_after`` they are compiled position-free
        once the answer is complete, so later requests reuse them at any position (``serve`` compiles
        them when its engine is idle instead). ``provided``: KV the caller holds for some reused items
        (plan index -> span: a worker's kept answer, ``synthesis.handles``), used instead of the store's."""
        after = None
        if plan.options is None:
            stream = Stream(self.engine, self.tokenizer, plan.ids, params)
            report = None
        else:
            asm = self.spans.assemble(plan, extra_capacity=params.max_new_tokens + 1, provided=provided)
            stream = Stream(self.engine, self.tokenizer, plan.ids, params, cache=asm.cache, first_logits=asm.logits)
            report = asm.report
            after = self.spans.compile_pending if compile_after else None
        self.weaver.record(plan.served, plan.tenant)
        return KitStream(stream, plan, report, after)

    stream = _planned(request, """Iterate over the returned stream for text deltas; its ``result`` holds the
        Generation (the arguments of ``request``).

        With ``reuse``, documents are spans: their KV is compiled once, kept in ``self.spans`` and
        re-positioned into later requests, recomputing what ``reuse`` says (see ReuseOptions).
        ``tenant`` is part of every span key and has its own ordering history: tenants share nothing.
        """)

    generate = _finished(stream, """Answer ``question`` over ``documents`` (the arguments of ``stream``): full
        prefill, or span reuse per ``reuse``. The Generation's ``reuse`` field reports what was reused,
        recomputed and prefilled.""")
