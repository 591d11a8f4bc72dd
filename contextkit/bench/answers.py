"""A method's greedy answer on the built-in engine, kept with its KV for scoring (``spans.fidelity.score``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.generation import Generation, SamplingParams
from contextkit.core.kvcache import KVCache
from contextkit.engine.generate import Detokenizer, Stream
from contextkit.spans.fidelity import MethodKV


def answered(engine: KVEngine, tokenizer: Detokenizer, prompt_ids: Sequence[int], cache: KVCache,
             first_logits: torch.Tensor, params: SamplingParams) -> tuple[MethodKV, Generation]:
    """A method's greedy answer from the KV it assembled (the prompt in ``cache``, ``first_logits``
    predicting the first answer token), with the cache truncated back to the prompt: the ``MethodKV`` to
    score once every method has run, and the generation (its text, for the answer-quality metrics)."""
    length = cache.length
    gen = Stream(engine, tokenizer, prompt_ids, params, cache=cache, first_logits=first_logits).finish()
    cache.truncate(length)
    return MethodKV(engine, cache, first_logits, tuple(gen.token_ids), gen.finish_reason == "stop"), gen


