"""Picking one token from logits under ``SamplingParams`` (torch; the built-in engine and the synthesis
workers use it, the proxy and the HTTP client never do)."""

from __future__ import annotations

import torch

from contextkit.core.generation import GREEDY_BELOW, SamplingParams


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token from (vocab,) float32 logits. A temperature below ``GREEDY_BELOW`` is greedy (vLLM's
    rule: dividing by it would overflow the logits); the top-p cut always keeps the most likely token."""
    if params.temperature < GREEDY_BELOW:
        return int(logits.argmax())
    scores = logits / params.temperature
    if params.top_k and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = scores.sort(descending=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum - sorted_scores.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        drop[0] = False  # rounding must not drop them all (top_p near 0 is greedy)
        scores = scores.scatter(0, order[drop], float("-inf"))
    return int(torch.multinomial(scores.softmax(-1), 1, generator=generator))
