"""The ContextKit facade: one object that holds the config, the model and its tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from contextkit.config import ContextKitConfig
from contextkit.engine.generate import Generation, SamplingParams, Stream
from contextkit.engine.model import Engine
from contextkit.models import Progress, prepare
from contextkit.prompt import render_prompt
from contextkit.tokenizer import Tokenizer
from contextkit.types import Evidence


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

    def prompt_ids(
        self, question: str, documents: Sequence[Evidence | str] = (), system: str | None = None
    ) -> list[int]:
        docs = [d if isinstance(d, Evidence) else Evidence(text=d) for d in documents]
        return render_prompt(self.tokenizer, question, docs, system)

    def stream(
        self,
        question: str,
        documents: Sequence[Evidence | str] = (),
        system: str | None = None,
        params: SamplingParams = SamplingParams(),
    ) -> Stream:
        """Iterate over the returned Stream for text deltas; its ``result`` holds the Generation."""
        return Stream(self.engine, self.tokenizer, self.prompt_ids(question, documents, system), params)

    def generate(
        self,
        question: str,
        documents: Sequence[Evidence | str] = (),
        system: str | None = None,
        params: SamplingParams = SamplingParams(),
    ) -> Generation:
        """Answer ``question`` over ``documents`` (full prefill; reuse arrives with the span cache)."""
        stream = self.stream(question, documents, system, params)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

