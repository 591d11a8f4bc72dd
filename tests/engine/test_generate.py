"""Decoding: greedy parity with transformers, stop tokens and strings, streaming, sampling, limits."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contextkit.core.errors import ConfigError, EmptyInputError, PromptTooLongError
from contextkit.core.generation import SamplingParams
from contextkit.core.planner import ChatRequest, Planner
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence
from contextkit.engine.generate import Stream, sample
from contextkit.engine.model import Engine


@pytest.fixture(scope="module")
def smol(smol_dir):
    return Engine.from_dir(smol_dir), Tokenizer(smol_dir), smol_dir


@pytest.fixture(scope="module")
def prompt(smol):
    _, tok, _ = smol
    docs = [Evidence("The Eiffel Tower is 330 metres tall and was built by Gustave Eiffel's company.", title="Eiffel")]
    return Planner(tok).plan(ChatRequest.ask("Who built the Eiffel Tower?", docs)).ids


@pytest.mark.slow  # long generations
def test_greedy_matches_transformers_generate(smol, prompt):
    from transformers import AutoModelForCausalLM

    engine, tok, d = smol
    hf = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):].tolist()
    ours = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=48)).finish()
    eos = set(engine.spec.eos_token_ids)
    assert ref[-1] in eos and ours.finish_reason == "stop"  # this prompt's answer ends before 48 tokens
    assert list(ours.token_ids) == ref[:-1]
    assert ours.prompt_tokens == len(prompt)


def test_stops_at_eos(smol, prompt):
    engine, tok, _ = smol
    g = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=200)).finish()
    assert g.finish_reason == "stop"
    assert len(g.token_ids) < 200
    assert not set(g.token_ids) & set(engine.spec.eos_token_ids)
    assert "Eiffel" in g.text


@pytest.mark.slow  # long generations
def test_min_new_tokens_holds_off_eos_and_stop_strings(smol, prompt):
    """vLLM's ``min_tokens``: the answer that ends at EOS goes on past it, and a stop string inside the
    first tokens does not cut it; past the minimum both end it again."""
    engine, tok, _ = smol
    free = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=200)).finish()
    n = len(free.token_ids)
    held = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=n + 8, min_new_tokens=n + 4)).finish()
    assert len(held.token_ids) >= n + 4 and list(held.token_ids[:n]) == list(free.token_ids)
    assert not set(held.token_ids[: n + 4]) & set(engine.spec.eos_token_ids)
    stop = free.text.split()[1]
    assert Stream(engine, tok, prompt, SamplingParams(max_new_tokens=40, stop=(stop,))).finish().finish_reason == "stop"
    early = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=6, stop=(stop,), min_new_tokens=6)).finish()
    assert len(early.token_ids) == 6 and early.finish_reason == "length"
    with pytest.raises(ConfigError, match="min_new_tokens"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


@pytest.mark.slow  # long generations
def test_stop_string_cuts_text_and_streaming_never_leaks_it(smol, prompt):
    engine, tok, _ = smol
    free = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=40)).finish()
    words = free.text.split()
    assert len(words) >= 3
    stop = " " + words[2]  # a stop string that occurs in the greedy answer
    run = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=40, stop=(stop,)))
    deltas = list(run)
    assert run.result is not None and run.result.finish_reason == "stop"
    assert "".join(deltas) == run.result.text
    assert stop not in run.result.text
    assert free.text.startswith(run.result.text)
    assert all(stop not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def test_streamed_deltas_add_up_to_the_text(smol, prompt):
    engine, tok, _ = smol
    run = Stream(engine, tok, prompt, SamplingParams(max_new_tokens=30))
    deltas = list(run)
    assert len(deltas) > 3
    assert "".join(deltas) == run.result.text


@pytest.mark.slow  # long generations
def test_sampling_is_seeded_and_respects_top_k(smol, prompt):
    engine, tok, _ = smol
    p = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7, stop_token_ids=())
    a = Stream(engine, tok, prompt, p).finish()
    b = Stream(engine, tok, prompt, p).finish()
    assert a.token_ids == b.token_ids
    logits = torch.randn(1000)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    g = torch.Generator().manual_seed(0)
    draws = {sample(logits, SamplingParams(temperature=2.0, top_k=3), g) for _ in range(200)}
    assert draws <= top3 and len(draws) > 1
    nucleus = {sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), g) for _ in range(20)}
    assert nucleus == {int(logits.argmax())}


def test_limits_and_bad_params(smol):
    engine, tok, _ = smol
    with pytest.raises(PromptTooLongError, match="context"):
        Stream(engine, tok, [1] * (engine.spec.max_positions - 10), SamplingParams(max_new_tokens=20))
    with pytest.raises(EmptyInputError):
        Stream(engine, tok, [], SamplingParams())
    for bad in (dict(max_new_tokens=0), dict(temperature=-1), dict(top_p=0), dict(stop=("",))):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)
    with pytest.raises(EmptyInputError, match="question"):
        ChatRequest.ask("   ")


@settings(max_examples=200, deadline=None)
@given(temperature=st.floats(0, 1e38), top_p=st.floats(5e-324, 1.0, exclude_min=False), top_k=st.integers(0, 100),
       seed=st.integers(0, 2**31))
def test_sample_is_a_valid_token_for_any_accepted_params(temperature, top_p, top_k, seed):
    """Any parameters the API accepts pick a real token: a tiny top_p or temperature was a NaN
    distribution and a 500 (found by fuzzing serve)."""
    logits = torch.randn(97, generator=torch.Generator().manual_seed(seed)) * 20
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    token = sample(logits, params, torch.Generator().manual_seed(seed))
    assert 0 <= token < 97
    if temperature < 1e-5 or top_p < 1e-30:
        assert token == int(logits.argmax())
