"""Answer-level fidelity metrics: known values on hand-built logits, teacher forcing on a real engine."""

from __future__ import annotations

import math

import pytest
import torch

from contextkit.bench.fidelity import (
    answer_logits,
    compare,
    gold_logprob,
    mean_kl,
    mean_logprob,
    reference_answer,
    tf_agreement,
)
from contextkit.core.errors import InputError
from contextkit.engine.model import Engine


def _onehot(ids: list[int], vocab: int = 5, hi: float = 4.0) -> torch.Tensor:
    out = torch.zeros(len(ids), vocab)
    out[torch.arange(len(ids)), torch.tensor(ids)] = hi
    return out


def test_tf_agreement_counts_every_position():
    logits = _onehot([1, 2, 3, 0])
    assert tf_agreement([1, 2, 3, 4], logits) == 0.75
    assert tf_agreement([1, 2, 3, 0], logits) == 1.0
    assert tf_agreement([0, 0, 0, 1], logits) == 0.0


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
    noisy = cache.clone()
    noisy.v[:, :, : len(prompt)] += torch.randn_like(noisy.v[:, :, : len(prompt)]) * 2.0
    worse = compare(ref, engine, noisy, first)
    assert worse.answer_kl > 1e-3


def test_top_kl_from_a_servers_top_logprobs():
    from contextkit.bench.fidelity import top_kl

    ref = {1: math.log(0.7), 2: math.log(0.2), 3: math.log(0.1)}
    assert top_kl(ref, ref) == 0.0
    out = {1: math.log(0.5), 2: math.log(0.4), 4: math.log(0.05)}  # token 3 not listed: counted at 0.05
    want = 0.7 * math.log(0.7 / 0.5) + 0.2 * math.log(0.2 / 0.4) + 0.1 * math.log(0.1 / 0.05)
    assert abs(top_kl(ref, out) - want) < 1e-12
    with pytest.raises(InputError, match="logprobs"):
        top_kl(ref, {})
