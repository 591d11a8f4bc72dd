"""Answer-level fidelity of an approximate KV against full prefill: what a user of the answer observes.

First-token top-1 and next-token KL judge one position; a greedy answer's token F1 lets one early
near-tie rewrite the rest of the sentence. The metrics here judge every answer token without letting a
divergence compound, by teacher forcing: the reference's greedy answer (full prefill, 32 tokens, and its
stop token when it stopped) is fed back over the method's KV, and at every position the method's
prediction is compared with the reference's.

- ``tf_agreement``: the share of the reference answer's tokens that are also the method's argmax (a mean
  of per-prompt shares in a bench's summary; ``tf_agreement_tokens`` beside it weighs each answer token
  once, so a three-token answer with one flip is not a third of a prompt's worth).
- ``tf_agreement_tie``: the same share, a disagreement counted only where it is not a near-tie: where the
  reference gives the method's token a log-probability more than ``NEAR_TIE_NATS`` below the target's
  (its own greedy token).
  Below that gap a flip is what the dtype alone does (the bf16 full prefill's flips against the fp32 one
  fall there: ``NEAR_TIE_NATS``), not a changed answer.
- ``answer_kl``: the mean over those positions of KL(reference || method), in nats.
- ``gold_logprob``: the mean log-probability per token of a gold answer (the data's) under a KV; a bench
  reports the method's minus full prefill's (``gold_logprob_delta``): does the model still use the evidence,
  whether or not a 135M model would generate that answer greedily.

Everything takes the cache a method assembled (prompt in slots ``0..length``) and the logits that predict
the first answer token, and leaves the cache at its length (teacher-forced tokens are truncated away), so
one cache serves several references and the gold answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.errors import InputError
from contextkit.core.kvcache import KVCache


@dataclass(frozen=True, slots=True)
class ReferenceAnswer:
    """A reference's answer as teacher-forcing targets, with the reference's own logits at each target."""

    targets: tuple[int, ...]
    logits: torch.Tensor  # (len(targets), vocab) float32


# The gap (nats, under the reference's own distribution) between its top-1 token and the method's token at
# or below which a flip is a near-tie: the reference rates the two within ~22% of each other. Chosen on the
# dtype floor (docs/benchmarks.md, "Near-ties"): every flip of the bf16 full prefill against the fp32 one,
# teacher-forced on tune questions, had a gap under it (SmolLM2-135M: 6 flips on 20 questions, max 0.083;
# Qwen2.5-Coder-0.5B: 1 flip on 10, 0.152); the default policy's flips reach 4.6-5.0 nats.
NEAR_TIE_NATS = 0.2


@dataclass(frozen=True, slots=True)
class AnswerFidelity:
    tf_agreement: float  # share of reference tokens that are the method's argmax (0..1)
    answer_kl: float  # mean KL(reference || method) per answer token, nats
    tokens: int = 0  # answer tokens compared (the weight of this prompt in a token-weighted agreement)
    agreed: int = 0  # of those, the method's argmax
    tie_agreed: int = 0  # of those, the method's argmax or a near-tie (``near_tie_agreed``)
    flip_gaps: tuple[float, ...] = ()  # at each disagreement, the reference's gap to the method's token (nats)

    @property
    def tf_agreement_tie(self) -> float:
        return self.tie_agreed / self.tokens if self.tokens else self.tf_agreement


def answer_logits(engine: KVEngine, cache: KVCache, first_logits: torch.Tensor,
                  answer_ids: Sequence[int]) -> torch.Tensor:
    """(len(answer_ids), vocab) float32 logits predicting each of ``answer_ids`` given the ones before it.

    ``first_logits`` (1, vocab) predict ``answer_ids[0]`` from the prompt in ``cache``; the others come
    from one forward of ``answer_ids[:-1]`` over it. The cache is truncated back to its length afterwards.
    """
    if not answer_ids:
        raise InputError("teacher forcing needs at least one answer token")
    rows = [first_logits.reshape(1, -1).float()]
    if len(answer_ids) > 1:
        start = cache.length
        try:
            out = engine.forward(cache, list(answer_ids[:-1]), logits="all")
        finally:
            cache.truncate(start)
        assert out is not None
        rows.append(out.float())
    return torch.cat(rows)


def reference_answer(engine: KVEngine, cache: KVCache, first_logits: torch.Tensor,
                     token_ids: Sequence[int], *, stopped: bool) -> ReferenceAnswer:
    """The reference's greedy ``token_ids`` as targets, plus its stop token when ``stopped``.

    The stop token is the reference's own argmax after its last token, so a method that would go on
    talking (or stop early) is counted as disagreeing there, as it is anywhere else.
    """
    ids = list(token_ids)
    if not ids:  # the reference stopped at once: its only target is the stop token
        row = first_logits.reshape(1, -1).float()
        return ReferenceAnswer((int(row[0].argmax()),), row)
    if not stopped:
        return ReferenceAnswer(tuple(ids), answer_logits(engine, cache, first_logits, ids))
    logits = answer_logits(engine, cache, first_logits, [*ids, 0])  # the dummy last id is never fed
    return ReferenceAnswer((*ids, int(logits[-1].argmax())), logits)


def hits(targets: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """Per position, whether the target is the argmax of the matching row of ``logits`` (n, vocab)."""
    _check_rows(len(targets), logits)
    return logits.argmax(-1) == torch.as_tensor(list(targets), dtype=torch.long)


def tf_agreement(targets: Sequence[int], logits: torch.Tensor) -> float:
    """Share of ``targets`` that are the argmax of the matching row of ``logits`` (n, vocab)."""
    return float(hits(targets, logits).float().mean())


def target_gaps(targets: Sequence[int], reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per position, the reference's log-probability of the target minus that of the method's argmax
    (rows are positions; 0 where they agree)."""
    _check_rows(len(targets), logits)
    _check_rows(len(targets), reference_logits)
    ref = reference_logits.float().log_softmax(-1)
    want = torch.as_tensor(list(targets), dtype=torch.long)[:, None]
    return ref.gather(-1, want)[:, 0] - ref.gather(-1, logits.argmax(-1)[:, None])[:, 0]


def near_tie_agreed(targets: Sequence[int], reference_logits: torch.Tensor, logits: torch.Tensor, *,
                    nats: float = NEAR_TIE_NATS) -> int:
    """Positions where the method's argmax is the target or a near-tie of it: the reference gives the
    method's token a log-probability at most ``nats`` below the target's (``target_gaps``)."""
    return near_ties(target_gaps(targets, reference_logits, logits), nats=nats)


def near_ties(gaps: torch.Tensor, *, nats: float = NEAR_TIE_NATS) -> int:
    """Positions of ``target_gaps`` at most ``nats``: agreements (gap 0) and near-ties."""
    return int((gaps <= nats).sum())


def token_gap(reference: Mapping[int, float], *, target: int, token: int) -> float:
    """The reference's log-prob of ``target`` minus ``token``'s, from the top logprobs a server returns; a
    token not listed counts at the list's smallest (so its gap is a lower bound)."""
    if not reference:
        raise InputError("a near-tie needs the reference's top logprobs; ask the server for logprobs")
    floor = min(reference.values())
    return reference.get(target, floor) - reference.get(token, floor)


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over rows of KL(softmax(reference) || softmax(logits)), in nats; rows are positions."""
    if reference_logits.shape != logits.shape:
        raise InputError(f"logits of shape {tuple(logits.shape)} cannot be compared with a reference of "
                         f"shape {tuple(reference_logits.shape)}")
    p = reference_logits.float().log_softmax(-1)
    q = logits.float().log_softmax(-1)
    return float((p.exp() * (p - q)).sum(-1).clamp_min(0).mean())


def top_kl(reference: Mapping[int, float], logprobs: Mapping[int, float]) -> float:
    """KL(reference || method) at one position from the top logprobs a server returns (vLLM: up to 20):
    summed over the reference's listed tokens; one missing from the method's list counts at that list's
    smallest logprob (an upper bound on its probability, so this under-states a large divergence a little)."""
    if not reference or not logprobs:
        raise InputError("top-logprob KL needs both lists non-empty; ask the server for logprobs")
    floor = min(logprobs.values())
    kl = sum(math.exp(lp) * (lp - logprobs.get(t, floor)) for t, lp in reference.items())
    return max(0.0, kl)


def mean_logprob(logits: torch.Tensor, token_ids: Sequence[int]) -> float:
    """Mean log-probability per token of ``token_ids`` under the matching rows of ``logits``."""
    _check_rows(len(token_ids), logits)
    lp = logits.float().log_softmax(-1)
    return float(lp.gather(-1, torch.as_tensor(list(token_ids), dtype=torch.long)[:, None]).mean())


def compare(reference: ReferenceAnswer, engine: KVEngine, cache: KVCache,
            first_logits: torch.Tensor) -> AnswerFidelity:
    """The method's fidelity (its KV in ``cache``) to ``reference`` over the whole answer."""
    logits = answer_logits(engine, cache, first_logits, reference.targets)
    n = len(reference.targets)
    hit = hits(reference.targets, logits)
    gaps = target_gaps(reference.targets, reference.logits, logits)
    agreed = int(hit.sum())
    return AnswerFidelity(agreed / n, mean_kl(reference.logits, logits), n, agreed, near_ties(gaps),
                          tuple(round(float(g), 4) for g in gaps[~hit]))


def gold_logprob(engine: KVEngine, cache: KVCache, first_logits: torch.Tensor,
                 gold_ids: Sequence[int]) -> float:
    """Mean log-probability per token of the gold answer ``gold_ids`` under the KV in ``cache``."""
    return mean_logprob(answer_logits(engine, cache, first_logits, gold_ids), gold_ids)


def _check_rows(n: int, logits: torch.Tensor) -> None:
    if n == 0:
        raise InputError("no answer tokens to compare")
    if logits.dim() != 2 or logits.shape[0] != n:
        raise InputError(f"{n} answer tokens need ({n}, vocab) logits, got shape {tuple(logits.shape)}")


@dataclass(frozen=True, slots=True)
class MethodKV:
    """What one method assembled for a prompt, kept for scoring after the timed runs."""

    engine: KVEngine
    cache: KVCache  # the prompt only (slots 0..length); the generated tokens truncated away
    first_logits: torch.Tensor  # (1, vocab): predicts the first answer token
    token_ids: tuple[int, ...]  # its greedy answer
    stopped: bool  # the answer ended on a stop token (not on the length limit)


def gold_ids(encode: Callable[[str], list[int]], answers: Sequence[str], limit: int) -> list[int] | None:
    """The first gold answer's tokens (at most ``limit``), or None when the data has no gold answer."""
    text = next((a.strip() for a in answers if a and a.strip()), None)
    return encode(text)[:limit] if text else None


def score(kvs: Mapping[str, MethodKV], *, same_dtype: str, fp32: str | None,
          gold: Sequence[int] | None) -> dict[str, dict[str, float | None]]:
    """Per method: fidelity over the whole answer to the same-dtype full prefill ``kvs[same_dtype]`` (keys
    ``tf_agreement``, ``tf_agreement_tie``, ``tf_tokens`` and ``tf_agreed`` (for a token-weighted
    agreement), ``flip_gaps``, ``answer_kl``, ``gold_logprob_delta``) and to the float32 one ``kvs[fp32]`` (the same
    keys ending in ``_fp32``; left out when ``fp32`` is None). ``gold`` None (no gold answer in the data):
    the gold keys are None."""
    names = {"": same_dtype} | ({"_fp32": fp32} if fp32 is not None else {})
    refs = {sfx: reference_answer(kvs[n].engine, kvs[n].cache, kvs[n].first_logits, kvs[n].token_ids,
                                  stopped=kvs[n].stopped) for sfx, n in names.items()}
    base = {sfx: _gold(kvs[n], gold) for sfx, n in names.items()}
    out: dict[str, dict[str, float | None]] = {}
    for name, kv in kvs.items():
        row: dict[str, float | None] = {}
        mine = _gold(kv, gold)
        for suffix, ref in refs.items():
            f = compare(ref, kv.engine, kv.cache, kv.first_logits)
            row[f"tf_agreement{suffix}"], row[f"answer_kl{suffix}"] = f.tf_agreement, f.answer_kl
            row[f"tf_agreement_tie{suffix}"], row[f"tf_tokens{suffix}"] = f.tf_agreement_tie, f.tokens
            row[f"tf_agreed{suffix}"], row[f"flip_gaps{suffix}"] = f.agreed, f.flip_gaps
            ref_gold = base[suffix]
            row[f"gold_logprob_delta{suffix}"] = None if mine is None or ref_gold is None else mine - ref_gold
        out[name] = row
    return out


def agreement(rows: Sequence[Mapping[str, float | None]], suffix: str = "") -> dict[str, float]:
    """Whole-answer agreement over prompts' ``score`` rows, three ways: ``tf_agreement`` (the mean of the
    per-prompt shares), ``tf_agreement_tokens`` (every answer token weighs the same) and
    ``tf_agreement_tie`` (near-ties not counted as disagreements; a mean over prompts), each + ``suffix``."""
    if not rows:
        raise InputError("no prompts to summarize")
    tokens = sum(r[f"tf_tokens{suffix}"] for r in rows)
    return {f"tf_agreement{suffix}": round(sum(r[f"tf_agreement{suffix}"] for r in rows) / len(rows), 3),
            f"tf_agreement_tokens{suffix}": round(sum(r[f"tf_agreed{suffix}"] for r in rows) / tokens, 3),
            f"tf_agreement_tie{suffix}": round(sum(r[f"tf_agreement_tie{suffix}"] for r in rows) / len(rows), 3)}


def _gold(kv: MethodKV, gold: Sequence[int] | None) -> float | None:
    return None if not gold else gold_logprob(kv.engine, kv.cache, kv.first_logits, gold)
