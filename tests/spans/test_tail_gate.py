"""The tail gate: a budget's setting that misses on a few prompts qualifies when its recompute's key shift
catches them (they run as full prefill), and only when that is expected to be faster."""

from __future__ import annotations

import dataclasses
import json

import pytest

from contextkit.core.errors import CalibrationError
from contextkit.core.policy import ReuseOptions, resolve_budget
from contextkit.spans.assemble import SpanCache
from contextkit.spans.calibration import Band, CalibrationProfile, Point, gated, profile_path

DIGEST = "ab" * 32
N = 19  # at quantile 0.9 one prompt of 19 may miss the budget (the bound is the 18th smallest)


def _point(ratio: float, kl: list[float], dev: list[float] | None, speedup: float) -> Point:
    return Point(ratio, tuple(kl), tuple(1.0 - min(k, 1.0) for k in kl), speedup, shift=tuple(dev or ()))


def _profile(*points: Point, q: float = 0.9) -> CalibrationProfile:
    return CalibrationProfile(model_digest=DIGEST, dtype="float32", quantile=q, answer_tokens=32, data="hand-made",
                              bands=(Band("1.5k", 1500, points),))


# r=0.1: two prompts of 19 in the tail (KL 0.4), and its recompute moved the keys most on exactly those
TAIL = [0.03] * 17 + [0.4, 0.4]
TRACKED = [0.10] * 17 + [0.30, 0.25]
CHEAP = _point(0.1, TAIL, TRACKED, speedup=4.0)
COSTLY = _point(0.3, [0.02] * 18 + [0.06], [0.05] * 19, speedup=2.0)


def test_a_setting_whose_tail_the_probe_tracks_runs_gated_and_faster():
    p = _profile(CHEAP, COSTLY)
    c = p.choose(0.1, 1500)
    # ungated, r=0.1 misses on two prompts where one is allowed: the loosest gate that holds the budget,
    # 0.25, sends one of them to full prefill
    assert (c.options.ratio, c.tail_gate) == (0.1, 0.25)
    assert gated(CHEAP, 0.25) == (0.03,) * 17 + (0.0, 0.4)
    assert c.predicted_kl == pytest.approx(0.03)  # the bound with the gated prompt counted as exact
    assert c.expected_speedup == pytest.approx(1 / (1 / 4.0 + 1 / 19), abs=1e-3)  # > r=0.3's 2.0x
    # the gate loosest first: a tail of one prompt is within the bound's margin, no gate at all
    one = dataclasses.replace(CHEAP, answer_kl=tuple([0.03] * 18 + [0.4]))
    assert _profile(one, COSTLY).choose(0.1, 1500).tail_gate is None
    # the budget resolved for a request carries the gate to either path (serve's assembler, the connector)
    got = resolve_budget(ReuseOptions(fidelity_budget=0.1), p, 1500)
    assert got.options.ratio == 0.1 and got.tail_gate == 0.25


def test_no_gate_is_chosen_where_the_estimate_does_not_track_the_tail():
    blind = dataclasses.replace(CHEAP, shift=tuple([0.2] * 17 + [0.05, 0.05]))  # the tail looks fine
    c = _profile(blind, COSTLY).choose(0.1, 1500)
    assert (c.options.ratio, c.tail_gate) == (0.3, None)
    # a gate that must send most prompts to full prefill is slower than the costlier ratio: not chosen
    loose = dataclasses.replace(CHEAP, shift=tuple([0.2] * 15 + [0.1, 0.1, 0.3, 0.3]))
    slow = dataclasses.replace(loose, answer_kl=tuple([0.03] * 15 + [0.4] * 4))
    c = _profile(slow, COSTLY).choose(0.1, 1500)
    assert (c.options.ratio, c.tail_gate) == (0.3, None)
    # a profile from before the estimate was kept: no gate, as before
    old = dataclasses.replace(CHEAP, shift=())
    assert _profile(old, COSTLY).choose(0.1, 1500).tail_gate is None


def test_a_gate_must_hold_the_costlier_settings_of_its_depth_too():
    """The envelope of the ungated rule, kept for gates: a cheap point gated under a costlier one that the
    same gate does not bring within the budget is a lucky point, not chosen."""
    bad = _point(0.3, [0.02] * 16 + [0.3, 0.3, 0.3], [0.01] * 19, speedup=2.0)  # its tail is invisible
    full_only = _profile(CHEAP, bad).choose(0.1, 1500)
    assert full_only.options.policy == "full"


def test_the_key_shift_is_the_mean_relative_change_of_the_recomputed_keys():
    import torch

    from contextkit.spans.recompute import key_shift

    k = torch.randn(3, 2, 5, 8)
    assert key_shift(k, k) == 0.0 and key_shift(k, 2 * k) == pytest.approx(1.0)
    moved = k.clone()
    moved[:, :, 0] = -k[:, :, 0]  # one token of five reversed: relative change 2 there
    assert key_shift(k, moved) == pytest.approx(2 / 5)


def test_the_estimate_round_trips_and_out_of_range_values_are_refused(tmp_path):
    p = _profile(CHEAP, COSTLY)
    path = profile_path(tmp_path, "float32")
    path.write_text(p.to_json())
    assert CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32") == p
    for value, message in (([0.1] * 3, "shift"), ([-0.5] * N, "negative"), (["0.1"] * N, "shift")):
        raw = json.loads(p.to_json())
        raw["bands"][0]["points"][0]["shift"] = value
        path.write_text(json.dumps(raw))
        with pytest.raises(CalibrationError, match=message):
            CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32")


@pytest.fixture(scope="module")
def compiled(smol_dir, passage_text):
    from contextkit.core.planner import ChatRequest, Planner
    from contextkit.core.tokenizer import Tokenizer
    from contextkit.core.types import Evidence
    from contextkit.engine.model import Engine

    engine, tok = Engine.from_dir(smol_dir), Tokenizer(smol_dir)
    blocks = [b for b in passage_text.split("\n\n") if b.strip()][:4]
    plan = Planner(tok).plan(ChatRequest.ask("Who was born first?",
                                             [Evidence(b, id=f"p{i}") for i, b in enumerate(blocks)],
                                             ordering="retrieval"))
    cache = SpanCache(engine, tokenizer_fingerprint=tok.fingerprint)
    for it in plan.items[:-1]:
        cache.compiled(it.span)
    return engine, tok, plan, cache


def _gated_cache(engine, tok, store, gate: float) -> SpanCache:
    """A profile whose one setting (r=0.2) holds a 0.05 budget only with its gate at ``gate``."""
    point = _point(0.2, [0.01] * 17 + [0.5, 0.5], [gate] * 17 + [2 * gate + 1e-3] * 2, speedup=3.0)
    profile = dataclasses.replace(_profile(point), model_digest=engine.fingerprint.digest)
    assert profile.choose(0.05, 1500).tail_gate == pytest.approx(gate)
    return SpanCache(engine, store=store, tokenizer_fingerprint=tok.fingerprint, profile=profile)


def test_a_request_over_the_gate_runs_as_full_prefill_and_says_so(compiled):
    engine, tok, plan, plain = compiled
    budget = dataclasses.replace(plan, options=ReuseOptions(fidelity_budget=0.05))
    full = plain.assemble(dataclasses.replace(plan, options=ReuseOptions(policy="full")))

    strict = _gated_cache(engine, tok, plain.store, gate=0.0)  # any move at all is over it
    got = strict.assemble(budget)
    r = got.report
    assert r.escalated and r.policy == "full" and r.reused_tokens == 0 and r.recomputed_tokens == 0
    assert r.recompute_shift is not None and r.recompute_shift > r.tail_gate == 0.0
    assert r.hits == len(plan.items) - 1 and r.select_ms > 0  # the fetch and the reuse ran first
    assert torch_equal(got.logits, full.logits)  # the same prefill of the same tokens: the reference

    loose = _gated_cache(engine, tok, plain.store, gate=50.0)  # a relative change of 50x: never
    r = loose.assemble(budget).report
    assert not r.escalated and r.policy == "query_attention" and r.recomputed_tokens > 0
    assert 0 < r.recompute_shift <= r.tail_gate == pytest.approx(50.0)


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))
