"""The ContextKit facade: one object that holds the config, the model and its tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from contextkit.config import ContextKitConfig

from contextkit.engine.generate import Generation, SamplingParams, Stream
from contextkit.engine.model import Engine
from contextkit.kernels.rerotate import Rerotator
from contextkit.models import Progress, prepare
from contextkit.plan import PlanItem, RequestPlan, ReuseOptions
from contextkit.prompt import render_prompt, render_segments
from contextkit.kvstore.tiered import build_store
from contextkit.spans.assemble import SpanCache
from contextkit.spans.store import KVSpanStore
from contextkit.tokenizer import Tokenizer
from contextkit.types import Evidence, Span


def resolve_model_dir(config: ContextKitConfig, progress: Progress | None = None) -> Path:
    """A prepared model directory for ``config.model``: an existing directory, or prepare a packaged model."""
    path = Path(config.model).expanduser()
    if path.is_dir():
        return path
    return prepare(config.model, config.cache_dir, progress=progress)


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
        self.model_dir = resolve_model_dir(self.config, progress)
        self.engine = Engine.from_dir(self.model_dir, self.config.dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        # documents seen by this kit keep their KV here, reused at any position by later requests
        self.spans = SpanCache(
            self.engine,
            store=KVSpanStore(build_store(self.config.kvstore)),
            rerotator=Rerotator("auto", build_dir=self.config.cache_dir / "kernels"),
            tokenizer_fingerprint=self.tokenizer.fingerprint,
        )

    def close(self) -> None:
        """Close the KV store's tiers (LMCache runs threads that would otherwise keep the process alive)."""
        self.spans.store.kv.close()

    def __enter__(self) -> ContextKit:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prompt_ids(
        self, question: str, documents: Sequence[Evidence | str] = (), system: str | None = None
    ) -> list[int]:
        docs = [d if isinstance(d, Evidence) else Evidence(text=d) for d in documents]
        return render_prompt(self.tokenizer, question, docs, system)

    def plan(
        self,
        question: str,
        documents: Sequence[Evidence | str] = (),
        system: str | None = None,
        reuse: ReuseOptions | None = None,
    ) -> RequestPlan:
        """The request as spans: system prefix, one span per document, the question (computed in context)."""
        docs = [d if isinstance(d, Evidence) else Evidence(text=d) for d in documents]
        seg = render_segments(self.tokenizer, question, docs, system)
        items = (
            PlanItem(Span(seg.prefix, "system")),
            *(PlanItem(Span(ids, "document", d.id or d.title)) for ids, d in zip(seg.documents, docs)),
            PlanItem(Span(seg.suffix, "query"), reuse=False),
        )
        return RequestPlan(items, reuse or ReuseOptions())

    def stream(
        self,
        question: str,
        documents: Sequence[Evidence | str] = (),
        system: str | None = None,
        params: SamplingParams = SamplingParams(),
        reuse: ReuseOptions | None = None,
        namespace: str = "",
    ) -> Stream:
        """Iterate over the returned Stream for text deltas; its ``result`` holds the Generation.

        With ``reuse``, documents are spans: their KV is compiled once, kept in ``self.spans`` and
        re-positioned into later requests, recomputing what ``reuse`` says (see ReuseOptions).
        ``namespace`` (a tenant) is part of every span key: tenants never share span KV.
        """
        if reuse is None:
            return Stream(self.engine, self.tokenizer, self.prompt_ids(question, documents, system), params)
        plan = self.plan(question, documents, system, reuse)
        asm = self.spans.assemble(plan, namespace=namespace, extra_capacity=params.max_new_tokens + 1)
        ids = [t for item in plan.items for t in item.span.token_ids]
        stream = Stream(self.engine, self.tokenizer, ids, params, cache=asm.cache, first_logits=asm.logits)
        stream.report = asm.report
        return stream

    def generate(
        self,
        question: str,
        documents: Sequence[Evidence | str] = (),
        system: str | None = None,
        params: SamplingParams = SamplingParams(),
        reuse: ReuseOptions | None = None,
        namespace: str = "",
    ) -> Generation:
        """Answer ``question`` over ``documents``: full prefill, or span reuse per ``reuse``.

        The Generation's ``reuse`` field reports what was reused, recomputed and prefilled; ``namespace``
        (a tenant) keeps span KV apart per tenant.
        """
        return self.stream(question, documents, system, params, reuse, namespace).finish()
