"""Decoding on the built-in engine: greedy and sampling, stop tokens and stop strings, token streaming.

``Stream`` is the one loop; ``generate`` drains it. Text is streamed as deltas that are safe to show:
a delta never contains the beginning of a stop string that may still complete, nor half a UTF-8
character (the tokenizer's replacement char at the end of the text is held back).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Literal, Protocol

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.errors import EmptyInputError, KVCacheError, PromptTooLongError
from contextkit.core.generation import GREEDY_BELOW, Generation, SamplingParams  # noqa: F401 - re-exported
from contextkit.core.kvcache import KVCache
from contextkit.core.sampling import sample  # noqa: F401 - re-exported


class Detokenizer(Protocol):
    def decode(self, token_ids: Sequence[int]) -> str: ...


class Stream:
    """Iterate to get text deltas; afterwards ``result`` holds the full Generation.

    ``first_logits`` given: the prompt is already in ``cache`` (e.g. assembled from spans) and these
    (1, vocab) logits predict the first token; ``prompt_ids`` are then only counted.
    """

    def __init__(
        self,
        engine: KVEngine,
        tokenizer: Detokenizer,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        cache: KVCache | None = None,
        first_logits: torch.Tensor | None = None,
    ):
        if first_logits is not None:
            if cache is None:
                raise KVCacheError("first_logits needs the cache that holds the prompt")
            if cache.capacity - cache.length < params.max_new_tokens:
                raise KVCacheError(
                    f"the cache has {cache.capacity - cache.length} free slots, fewer than max_new_tokens="
                    f"{params.max_new_tokens}; assemble with more extra capacity"
                )
        self.first_logits = first_logits
        if len(prompt_ids) == 0:
            raise EmptyInputError("the prompt is empty; pass at least one token")
        need = len(prompt_ids) + params.max_new_tokens
        if need > engine.spec.max_positions:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens and {params.max_new_tokens} new tokens were asked for, "
                f"but the model's context is {engine.spec.max_positions}; shorten the prompt (fewer or shorter "
                "documents) or lower max_new_tokens"
            )
        self.engine, self.tokenizer, self.params = engine, tokenizer, params
        self.prompt_ids = list(prompt_ids)
        self.cache = cache if cache is not None else engine.new_cache(need)
        self.result: Generation | None = None
        self.prompt_slots: int | None = None  # cache slots the prompt fills; generated tokens' KV follows

    def __iter__(self) -> Iterator[str]:
        p, engine = self.params, self.engine
        stop_ids = set(engine.spec.eos_token_ids if p.stop_token_ids is None else p.stop_token_ids)
        banned = sorted(stop_ids)  # masked out of the logits while the answer is shorter than min_new_tokens
        generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        hold = max((len(s) for s in p.stop), default=1) - 1  # chars that may start a stop string
        out: list[int] = []
        steps = 0  # forward passes after the prefill
        emitted = 0
        text = ""
        finish: Literal["stop", "length"] = "length"

        t0 = time.perf_counter()
        logits = self.first_logits if self.first_logits is not None else engine.forward(self.cache, self.prompt_ids)
        assert logits is not None
        self.prompt_slots = self.cache.length
        token = sample(_ban(logits[0], banned, p.min_new_tokens > 0), p, generator)
        t_first = time.perf_counter()
        while True:
            if token in stop_ids:
                finish = "stop"
                break
            out.append(token)
            text = self.tokenizer.decode(out)
            cut = _find_stop(text, p.stop, max(0, emitted - hold)) if len(out) >= p.min_new_tokens else None
            if cut is not None:
                text, finish = text[:cut], "stop"
                break
            safe = len(text) - hold
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if len(out) >= p.max_new_tokens:
                break
            logits = engine.forward(self.cache, [token])
            steps += 1
            assert logits is not None
            token = sample(_ban(logits[0], banned, len(out) < p.min_new_tokens), p, generator)
        t_end = time.perf_counter()
        if len(text) > emitted:
            yield text[emitted:]
        self.result = Generation(
            text=text,
            token_ids=tuple(out),
            finish_reason=finish,
            prompt_tokens=len(self.prompt_ids),
            prefill_ms=(t_first - t0) * 1e3,
            decode_ms_per_token=(t_end - t_first) * 1e3 / steps if steps else 0.0,
        )

    def finish(self) -> Generation:
        """Run to the end (discarding deltas) and return the Generation."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def _find_stop(text: str, stops: Sequence[str], start: int) -> int | None:
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _ban(logits: torch.Tensor, token_ids: list[int], on: bool) -> torch.Tensor:
    """``logits`` with ``token_ids`` made impossible when ``on`` (a copy; the engine's row is left alone)."""
    if not on or not token_ids:
        return logits
    out = logits.clone()
    out[token_ids] = float("-inf")
    return out
