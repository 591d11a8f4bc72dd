"""Answer-level fidelity metrics: known values on hand-built logits, teacher forcing on a real engine."""

from __future__ import annotations

import math

import pytest
import torch

from contextkit.core.errors import InputError
from contextkit.engine.model import Engine
from contextkit.spans.fidelity import (
    NEAR_TIE_NATS,
    agreement,
    answer_logits,
    compare,
    gold_logprob,
    mean_kl,
    mean_logprob,
    near_tie_agreed,
    reference_answer,
    tf_agreement,
    token_gap,
)


def _onehot(ids: list[int], vocab: int = 5, hi: float = 4.0) -> torch.Tensor:
    out = torch.zeros(len(ids), vocab)
    out[torch.arange(len(ids)), torch.tensor(ids)] = hi
    return out


def test_tf_agreement_counts_every_position():
    logits = _onehot([1, 2, 3, 0])
    assert tf_agreement([1, 2, 3, 4], logits) == 0.75
    assert tf_agreement([1, 2, 3, 0], logits) == 1.0
    assert tf_agreement([0, 0, 0, 1], logits) == 0.0


def test_a_flip_counts_against_near_tie_agreement_only_past_the_gap():
    """The reference's target is token 0 at every position; the method picks 0, then 1, then 2. Token 1 is
    a near-tie under the reference (0.04 nats below the target), token 2 a real change (3 nats below)."""
    ref = torch.tensor([[0.0, -0.04, -3.0]] * 3)
    method = _onehot([0, 1, 2], vocab=3)
    assert tf_agreement([0, 0, 0], method) == pytest.approx(1 / 3)
    assert near_tie_agreed([0, 0, 0], ref, method) == 2
    assert near_tie_agreed([0, 0, 0], ref, method, nats=0.01) == 1
    assert near_tie_agreed([0, 0, 0], ref, method, nats=3.0) == 3
    with pytest.raises(InputError, match="answer tokens"):
        near_tie_agreed([0, 0], ref[:2], method)


def test_token_gap_reads_the_references_top_logprobs():
    ref = {7: -0.2, 9: -0.25, 4: -5.0}
    assert token_gap(ref, target=7, token=7) == 0.0
    assert token_gap(ref, target=7, token=9) == pytest.approx(0.05)
    assert token_gap(ref, target=7, token=123) == pytest.approx(4.8)  # not listed: at the list's smallest
    assert token_gap(ref, target=7, token=9) <= NEAR_TIE_NATS < token_gap(ref, target=7, token=4)
    with pytest.raises(InputError, match="logprobs"):
        token_gap({}, target=1, token=1)


def test_agreement_weighs_prompts_and_tokens_differently():
    """A 3-token answer with one real flip and a 9-token answer with none: the per-prompt mean is
    (2/3 + 1) / 2, the token-weighted share 11/12; a near-tie flip is no disagreement for the tie column."""
    rows = [{"tf_agreement": 2 / 3, "tf_agreed": 2, "tf_tokens": 3, "tf_agreement_tie": 1.0},
            {"tf_agreement": 1.0, "tf_agreed": 9, "tf_tokens": 9, "tf_agreement_tie": 1.0}]
    assert agreement(rows) == {"tf_agreement": round(5 / 6, 3), "tf_agreement_tokens": round(11 / 12, 3),
                               "tf_agreement_tie": 1.0}
    with pytest.raises(InputError, match="no prompts"):
        agreement([])


def test_mean_kl_is_the_average_of_per_position_kl():
    ref = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]]))
    same, other = ref.clone(), torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    assert mean_kl(ref, same) == pytest.approx(0.0, abs=1e-7)
    kl_row2 = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert mean_kl(ref, other) == pytest.approx(kl_row2 / 2, rel=1e-5)
    with pytest.raises(InputError, match="shape"):
        mean_kl(ref, other[:1])


def test_mean_logprob_of_known_distribution():
    logits = torch.log(torch.tensor([[0.25, 0.75], [0.5, 0.5]]))
    assert mean_logprob(logits, [1, 0]) == pytest.approx((math.log(0.75) + math.log(0.5)) / 2, rel=1e-6)
    with pytest.raises(InputError, match="answer tokens"):
        mean_logprob(logits, [1])
    with pytest.raises(InputError, match="no answer tokens"):
        tf_agreement([], logits[:0])


@pytest.fixture(scope="module")
def engine(tiny_dirs) -> Engine:
    return Engine.from_dir(tiny_dirs["qwen2"], dtype="float32")


def test_teacher_forcing_equals_one_forward_of_prompt_and_answer(engine):
    prompt, answer = [5, 17, 33, 2, 9, 100, 41], [7, 8, 200, 3]
    whole = engine.new_cache(16)
    expect = engine.forward(whole, prompt + answer[:-1], logits="all")[len(prompt) - 1:]
    cache = engine.new_cache(16)
    first = engine.forward(cache, prompt)
    got = answer_logits(engine, cache, first, answer)
    assert cache.length == len(prompt)  # the teacher-forced tokens are gone again
    torch.testing.assert_close(got, expect, rtol=1e-4, atol=1e-4)
    # the same cache serves a second answer: nothing of the first stayed behind
    torch.testing.assert_close(answer_logits(engine, cache, first, answer), got)
    assert gold_logprob(engine, cache, first, answer) == pytest.approx(mean_logprob(expect, answer), rel=1e-5)


def test_reference_counts_its_stop_token_and_a_perturbed_kv_scores_lower(engine):
    prompt, answer = [5, 17, 33, 2, 9, 100, 41], [7, 8, 200]
    cache = engine.new_cache(16)
    first = engine.forward(cache, prompt)
    ref = reference_answer(engine, cache, first, answer, stopped=True)
    assert ref.targets[:3] == tuple(answer) and len(ref.targets) == 4
    assert ref.logits.shape[0] == 4
    assert int(ref.logits[3].argmax()) == ref.targets[3]
    exact = compare(ref, engine, cache, first)
    assert exact.answer_kl == pytest.approx(0.0, abs=1e-6)
    # the reference's answer is not its own greedy choice, so agreement counts argmax hits, not 1.0 by fiat
    greedy = sum(int(ref.logits[i].argmax()) == t for i, t in enumerate(ref.targets)) / 4
    assert exact.tf_agreement == greedy
    # its own argmax is never below the target under its own distribution: no disagreement is past a near-tie
    assert (exact.tokens, exact.agreed, exact.tie_agreed) == (4, round(greedy * 4), 4)
    noisy = cache.clone()
    noisy.v[:, :, : len(prompt)] += torch.randn_like(noisy.v[:, :, : len(prompt)]) * 2.0
    worse = compare(ref, engine, noisy, first)
    assert worse.answer_kl > 1e-3


def test_top_kl_from_a_servers_top_logprobs():
    from contextkit.spans.fidelity import top_kl

    ref = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    assert top_kl(ref, ref) == 0.0
    out = {1: math.log(0.5), 2: math.log(0.4), 4: math.log(0.05)}  # token 3 not listed: counted at 0.05
    want = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.4) + 0.1 * math.log(0.1 / 0.05)
    assert abs(top_kl(ref, out) - want) < 1e-12
    with pytest.raises(InputError, match="logprobs"):
        top_kl(ref, {})
