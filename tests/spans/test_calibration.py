"""The calibration profile: which setting a budget chooses, and which profiles are refused."""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contextkit.core.errors import CalibrationError, ConfigError, InputError
from contextkit.core.policy import DEFAULT_FIDELITY_BUDGET, ReuseOptions
from contextkit.spans.assemble import SpanCache
from contextkit.spans.calibration import (
    Band,
    CalibrationProfile,
    Point,
    find_profile,
    minimum_prompts,
    profile_path,
    upper_bound,
)

DIGEST = "ab" * 32


N = 19  # prompts per hand-made point: at quantile 0.9 the bound is the 18th smallest, the second largest


def _point(ratio: float, typical: float, worst: tuple[float, ...] = (), speedup: float | None = None) -> Point:
    """N prompts: ``worst`` as given, the rest at ``typical``."""
    kls = (typical,) * (N - len(worst)) + worst
    return Point(ratio, kls, tuple(1.0 - k for k in kls), speedup=1.0 / (0.2 + ratio) if speedup is None else speedup)


def _profile(bands: tuple[Band, ...], q: float = 0.9) -> CalibrationProfile:
    return CalibrationProfile(model_digest=DIGEST, dtype="float32", quantile=q, answer_tokens=32, data="hand-made",
                              bands=bands)


SHORT = Band("1.5k", 1500, (
    _point(0.0, 0.40),
    _point(0.1, 0.05, worst=(0.12, 0.12)),  # two prompts in the tail: bounded by 0.12
    _point(0.3, 0.01, worst=(0.04, 0.5)),  # one outlier of 19 is within the margin: bounded by 0.04
    _point(0.5, 0.005, worst=(0.02,)),
))
LONG = Band("4k", 4000, (
    _point(0.0, 0.2),
    _point(0.1, 0.01),  # lucky: below the budget while a costlier point is above it
    _point(0.3, 0.09),
    _point(0.5, 0.01),
))


def test_the_bound_is_the_conformal_order_statistic():
    assert upper_bound(tuple(range(1, 20)), 0.9) == 18  # ceil(20 * 0.9) = 18th smallest of 19
    assert upper_bound(tuple(range(1, 17)), 0.9) == 16  # of 16: the largest
    assert upper_bound((3.0, 1.0, 2.0), 0.5) == 2.0
    assert upper_bound(tuple(range(1, 9)), 0.9) == math.inf  # 8 prompts cannot bound a 90% quantile
    assert minimum_prompts(0.9) == 9 and minimum_prompts(0.5) == 1 and minimum_prompts(0.95) == 19
    for bad in (0.0, 1.0):
        with pytest.raises(CalibrationError, match=r"\(0, 1\)"):
            minimum_prompts(bad)


def test_the_cheapest_setting_within_the_budget_for_the_nearest_band():
    p = _profile((SHORT, LONG))
    c = p.choose(0.05, 1400)
    # r=0.3 is bounded by 0.04 (its 0.5 outlier is the one prompt in 19 the margin allows), r=0.1 by 0.12
    assert c.band == "1.5k" and c.options.policy == "query_attention" and c.options.ratio == 0.3
    assert c.options.max_recompute is None and c.predicted_kl == pytest.approx(0.04)
    assert p.choose(0.2, 1400).options.ratio == 0.1
    assert p.choose(1.0, 1400).options.ratio == 0.0  # everything fits: reuse with the sinks only
    assert p.choose(0.001, 1400).options.policy == "full"  # nothing fits: exact
    assert p.band_for(3000).name == "4k" and p.band_for(2000).name == "1.5k" and p.band_for(50_000).name == "4k"


def test_a_lucky_point_below_a_bad_one_is_never_chosen():
    c = _profile((SHORT, LONG)).choose(0.05, 4000)
    assert c.band == "4k" and c.options.ratio == 0.5  # not r=0.1, though its own KL is within the budget
    assert _profile((SHORT, LONG)).choose(0.1, 4000).options.ratio == 0.1


def test_the_fastest_qualifying_setting_is_chosen_and_never_one_slower_than_full_prefill():
    band = Band("1.5k", 1500, (
        _point(0.0, 0.3, speedup=6.0),
        _point(0.2, 0.06, speedup=0.9),  # within 0.1, but measured slower than a costlier setting
        _point(0.5, 0.03, speedup=1.2),
        _point(0.7, 0.01, speedup=0.95),  # the only one within 0.02: full prefill is exact and faster
    ))
    p = _profile((band,))
    assert p.choose(0.02, 1500).options.policy == "full"
    assert p.choose(0.05, 1500).options.ratio == 0.5
    assert p.choose(0.1, 1500).options.ratio == 0.5  # faster than r=0.2 and more faithful
    assert p.choose(1.0, 1500).options.ratio == 0.0


def test_a_deeper_probe_is_chosen_where_it_reaches_the_budget_faster():
    """The probe through all layers (0) costs more per request than through 8, but reaches a budget at a
    lower ratio: the measured speed decides, the envelope is kept per depth."""
    shallow = (_point(0.2, 0.15, speedup=2.2), _point(0.3, 0.12, speedup=1.7), _point(0.5, 0.04, speedup=1.2))
    deep = tuple(dataclasses.replace(pt, probe_layers=0) for pt in (
        _point(0.2, 0.11, speedup=1.8), _point(0.3, 0.06, speedup=1.4), _point(0.5, 0.03, speedup=1.0)))
    p = _profile((Band("1.5k", 1500, shallow + deep),))
    c = p.choose(0.1, 1500)
    assert (c.options.ratio, c.options.probe_layers, c.predicted_kl) == (0.3, 0, 0.06)  # 1.4x, not 8 layers' 1.2x
    c = p.choose(0.2, 1500)
    assert (c.options.ratio, c.options.probe_layers) == (0.2, 8)  # both depths fit: 8 layers' 2.2x wins
    near = dataclasses.replace(deep[2], speedup=1.17)  # within 5% of 8 layers' r=0.5 (1.2x), and tighter
    c = _profile((Band("1.5k", 1500, shallow + deep[:2] + (near,)),)).choose(0.05, 1500)
    assert (c.options.ratio, c.options.probe_layers, c.predicted_kl) == (0.5, 0, 0.03)  # a tie: fidelity wins
    lucky = dataclasses.replace(deep[0], answer_kl=(0.01,) * N, speedup=3.0)  # below a bad costlier point
    bad = dataclasses.replace(deep[1], answer_kl=(0.3,) * N)
    c = _profile((Band("1.5k", 1500, shallow + (lucky, bad, deep[2])),)).choose(0.1, 1500)
    assert (c.options.ratio, c.options.probe_layers) == (0.5, 8)  # the envelope holds within a depth


def test_first_k_alone_is_a_series_of_its_own_chosen_where_it_reaches_the_budget_fastest():
    """first_k at several k (EPIC's LegoLink: each reused span's first k tokens recomputed, no probe) beside
    query_attention's ratios: its points are ordered by k, and the fastest qualifying setting of any series
    runs, as the options a request gets (policy first_k, ratio 0)."""
    qa = (_point(0.0, 0.4, speedup=12.0), _point(0.2, 0.08, speedup=3.0), _point(0.3, 0.04, speedup=2.3))
    fk = tuple(dataclasses.replace(_point(0.0, kl, speedup=sp), first_k=k, policy="first_k")
               for k, kl, sp in ((16, 0.2, 5.0), (32, 0.09, 3.5), (64, 0.05, 2.2)))
    p = _profile((Band("1.5k", 1500, qa + fk),))
    c = p.choose(0.1, 1500)  # k=32 (3.5x) and r=0.2 (3.0x) both hold 0.1: the faster runs
    assert (c.options.policy, c.options.first_k, c.options.ratio, c.predicted_kl) == ("first_k", 32, 0.0, 0.09)
    assert c.options.max_recompute is None and c.expected_speedup == 3.5
    c = p.choose(0.05, 1500)  # k=64 (2.2x) ties r=0.3 (2.3x) within 5%: r=0.3's smaller bound wins
    assert (c.options.policy, c.options.ratio, c.options.first_k) == ("query_attention", 0.3, 2)
    assert p.choose(0.5, 1500).options.policy == "query_attention"  # r=0 (12x) beats every k
    lucky = dataclasses.replace(fk[0], answer_kl=(0.01,) * N)  # k=16 below a costlier k=32 that misses 0.05
    c = _profile((Band("1.5k", 1500, qa + (lucky,) + fk[1:]),)).choose(0.05, 1500)
    assert c.options.policy == "query_attention"  # the envelope holds within the k series
    assert CalibrationProfile.from_json(p.to_json()) == p  # a point's k round-trips
    assert p.series(fk[0]) == ("first_k", 0) and p.series(qa[1]) == ("query_attention", 8)


def test_too_few_prompts_bound_nothing_and_the_profile_says_so(tmp_path, caplog):
    few = Band("1.5k", 1500, (Point(0.0, (0.01,) * 8, (1.0,) * 8, 5.0),))
    p = _profile((few,))
    assert p.choose(1.0, 1500).options.policy == "full"  # 8 prompts cannot bound a 90% quantile
    assert _profile((few,), q=0.5).choose(1.0, 1500).options.ratio == 0.0
    path = profile_path(tmp_path, "float32")
    path.write_text(p.to_json())
    with caplog.at_level(logging.WARNING, logger="contextkit.spans.calibration"):
        CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32")
    assert any("fewer than 9 prompts" in m and "--n 24" in m for m in caplog.messages)


def test_a_profile_round_trips_and_is_refused_for_other_weights_or_dtype(tmp_path):
    p = _profile((SHORT, LONG))
    path = profile_path(tmp_path, "float32")
    path.write_text(p.to_json())
    assert CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32") == p
    deep = _profile((Band("1.5k", 1500, (dataclasses.replace(SHORT.points[0], probe_layers=0),)),))
    assert CalibrationProfile.from_json(deep.to_json()) == deep  # a point's own depth round-trips
    assert SHORT.points[0].probe_layers is None and p.depth(SHORT.points[0]) == p.probe_layers == 8  # files before it
    with pytest.raises(CalibrationError, match="other weights"):
        CalibrationProfile.load(path, model_digest="cd" * 32, dtype="float32")
    with pytest.raises(CalibrationError, match="bfloat16"):
        CalibrationProfile.load(path, model_digest=DIGEST, dtype="bfloat16")
    # found beside the model: a profile for other weights is ignored (with a warning), an explicit one refused
    assert find_profile(tmp_path, model_digest="cd" * 32, dtype="float32") is None
    assert find_profile(tmp_path, model_digest=DIGEST, dtype="bfloat16") is None  # none for that dtype
    with pytest.raises(CalibrationError):
        find_profile(tmp_path, model_digest="cd" * 32, dtype="float32", explicit=path)
    # a profile measured on spans saved out of another request's context (vLLM's connector): a file of its
    # own, found only for that source, refused for the other
    ctx = dataclasses.replace(p, kv_source="context")
    profile_path(tmp_path, "float32", "context").write_text(ctx.to_json())
    assert find_profile(tmp_path, model_digest=DIGEST, dtype="float32", kv_source="context") == ctx
    assert find_profile(tmp_path, model_digest=DIGEST, dtype="float32") == p and ctx.id == p.id + "-context"
    with pytest.raises(CalibrationError, match="kv_source=context"):
        find_profile(tmp_path, model_digest=DIGEST, dtype="float32", kv_source="context", explicit=path)
    deep = json.loads(ctx.to_json())
    deep["bands"][0]["points"][0].update(policy="kv_deviation", probe_layers=0)
    with pytest.raises(CalibrationError, match="kv_deviation point runs no probe"):
        CalibrationProfile.from_json(json.dumps(deep))
    path.write_text('{"format": "something else"}')
    with pytest.raises(CalibrationError, match="contextkit calibrate"):
        CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32")
    path.write_text("{not json")
    with pytest.raises(CalibrationError, match="cannot be read"):
        CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32")


def test_a_profile_timed_on_another_machine_is_used_and_says_how_to_re_time_it(tmp_path, caplog):
    from contextkit.core.config import machine_class

    path = profile_path(tmp_path, "float32")
    for machine, warned in (("elsewhere/avx2/64c", True), (machine_class(), False), ("", False)):
        p = dataclasses.replace(_profile((SHORT,)), machine=machine)
        path.write_text(p.to_json())
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="contextkit.spans.calibration"):
            assert CalibrationProfile.load(path, model_digest=DIGEST, dtype="float32") == p
        said = [m for m in caplog.messages if "speeds_from" in m]
        assert bool(said) == warned and (not warned or machine in said[0] and machine_class() in said[0])


def _good() -> dict:
    return json.loads(_profile((SHORT, LONG)).to_json())


def _set(raw: dict, path: tuple, value) -> dict:
    at = raw
    for part in path[:-1]:
        at = at[part]
    at[path[-1]] = value
    return raw


@pytest.mark.parametrize("path, value, field", [
    (("bands", 0, "points", 1, "ratio"), 1.5, "bands[0].points[1].ratio"),
    (("bands", 0, "points", 1, "ratio"), -0.1, "bands[0].points[1].ratio"),
    (("bands", 0, "points", 1, "ratio"), "0.3", "bands[0].points[1].ratio"),
    (("bands", 0, "points", 0, "first_k"), 0, "bands[0].points[0].first_k"),
    (("bands", 0, "points", 0, "first_k"), 8.5, "bands[0].points[0].first_k"),
    (("bands", 0, "points", 1, "first_k"), 16, "bands[0].points[1]"),  # a first_k point at ratio 0.1
    (("bands", 0, "points", 0, "probe_layers"), -1, "bands[0].points[0].probe_layers"),
    (("bands", 0, "points", 0, "probe_layers"), 8.5, "bands[0].points[0].probe_layers"),
    (("bands", 1, "points", 2, "answer_kl"), "abc", "bands[1].points[2].answer_kl"),
    (("bands", 1, "points", 2, "answer_kl", 3), "0.1", "bands[1].points[2].answer_kl[3]"),
    (("bands", 1, "points", 2, "answer_kl", 3), float("nan"), "bands[1].points[2].answer_kl[3]"),
    (("bands", 1, "points", 2, "answer_kl", 3), -0.5, "bands[1].points[2]"),
    (("bands", 1, "points", 2, "answer_kl"), [], "bands[1].points[2].answer_kl"),
    (("bands", 1, "points", 2, "tf_agreement"), [0.5], "bands[1].points[2]"),
    (("bands", 1, "points", 0, "speedup"), 0, "bands[1].points[0].speedup"),
    (("bands", 1, "points", 0, "speedup"), float("inf"), "bands[1].points[0].speedup"),
    (("bands", 1, "points", 0, "speedup"), True, "bands[1].points[0].speedup"),
    (("bands", 0, "context_tokens"), -5, "bands[0].context_tokens"),
    (("bands", 0, "points"), [], "bands[0].points"),
    (("bands",), [], "bands"),
    (("quantile",), 1.0, "quantile"),
    (("quantile",), 0, "quantile"),
    (("quantile",), float("nan"), "quantile"),
    (("first_k",), -2, "first_k"),
    (("probe_layers",), -3, "probe_layers"),
    (("answer_tokens",), 0, "answer_tokens"),
    (("bands", 0, "points", 0, "surprise"), 1, "bands[0].points[0].surprise"),
    (("bands", 0, "points", 0, "policy"), "budget", "bands[0].points[0]"),  # not a calibrated setting
    (("bands", 0, "points", 0, "policy"), "first_k", "bands[0].points[0]"),  # without a k
    (("kv_source",), "vllm", "kv_source"),
])
def test_a_profile_with_a_value_out_of_range_is_refused_naming_the_field(tmp_path, path, value, field):
    """Each of these loaded before and raised later, inside vLLM's scheduler on the first budget request."""
    file = profile_path(tmp_path, "float32")
    file.write_text(json.dumps(_set(_good(), path, value)))
    with pytest.raises(CalibrationError) as err:
        CalibrationProfile.load(file, model_digest=DIGEST, dtype="float32")
    assert f"{field}:" in str(err.value) and "contextkit calibrate" in str(err.value)
    assert find_profile(tmp_path, model_digest=DIGEST, dtype="float32") is None  # beside the model: ignored


_JSONISH = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True),
                     st.text(max_size=3), st.lists(st.floats(-1, 2), max_size=3))
_FIELDS = [("ratio",), ("answer_kl",), ("answer_kl", 0), ("tf_agreement", 1), ("speedup",), ("probe_layers",),
           ("shift",), ("first_k",), ("policy",)]


@settings(max_examples=150, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 3), st.sampled_from(_FIELDS), _JSONISH),
                      min_size=1, max_size=3),
       top=st.sampled_from([None, "first_k", "probe_layers", "quantile", "kv_source"]), top_value=_JSONISH,
       budget=st.floats(0.001, 1.0), tokens=st.integers(0, 100_000))
def test_whatever_a_profile_holds_it_is_refused_at_load_or_chooses_without_raising(edits, top, top_value, budget,
                                                                                   tokens):
    raw = _good()
    for band, point, path, value in edits:
        target = raw["bands"][band]["points"][point]
        if len(path) == 2 and not isinstance(target.get(path[0]), list):
            continue
        _set(target, path, value)
    if top is not None:
        raw[top] = top_value
    try:
        profile = CalibrationProfile.from_json(json.dumps(raw))
    except CalibrationError as exc:
        assert "contextkit calibrate" in str(exc)
        return
    choice = profile.choose(budget, tokens)  # what the connector's scheduler calls: never raises
    assert choice.options.policy in ("full", "query_attention", "first_k", "kv_deviation")
    assert 0.0 <= choice.options.ratio <= 1.0
    assert choice.tail_gate is None or choice.tail_gate >= 0.0


def test_budget_options_check_their_range_and_policy():
    assert ReuseOptions().policy == "budget" and ReuseOptions().budget == DEFAULT_FIDELITY_BUDGET
    assert ReuseOptions(fidelity_budget=0.1).budget == 0.1 and ReuseOptions(fidelity_budget=1.0).budget == 1.0
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(InputError, match=r"\(0, 1\]") as err:
            ReuseOptions(fidelity_budget=bad)
        assert err.value.param == "fidelity_budget"
    with pytest.raises(ConfigError, match="attention_budget"):
        ReuseOptions(policy="query_attention", fidelity_budget=0.1)
    fb = ReuseOptions(policy="query_attention", ratio=0.2).fallback()
    assert fb.policy == "query_attention" and fb.ratio == 0.2 and fb.max_recompute == ReuseOptions().max_recompute


@pytest.fixture(scope="module")
def assembled(smol_dir, passage_text):
    from contextkit.core.planner import ChatRequest, Planner
    from contextkit.core.tokenizer import Tokenizer
    from contextkit.core.types import Evidence
    from contextkit.engine.model import Engine

    engine, tok = Engine.from_dir(smol_dir), Tokenizer(smol_dir)
    blocks = [b for b in passage_text.split("\n\n") if b.strip()][:4]
    docs = [Evidence(b, id=f"p{i}") for i, b in enumerate(blocks)]
    plan = Planner(tok).plan(ChatRequest.ask("Who was born first?", docs, ordering="retrieval"))
    return engine, tok, plan


def test_the_assembler_resolves_the_budget_and_reports_which_profile_chose(assembled, caplog):
    engine, tok, plan = assembled
    plain = SpanCache(engine, tokenizer_fingerprint=tok.fingerprint)
    for it in plan.items[:-1]:  # compiled ahead, as a corpus is
        plain.compiled(it.span)
    with caplog.at_level(logging.WARNING, logger="contextkit.spans.assemble"):
        r1 = plain.assemble(dataclasses.replace(plan, options=ReuseOptions())).report
        r2 = plain.assemble(dataclasses.replace(plan, options=ReuseOptions())).report
    assert [m for m in caplog.messages if "contextkit calibrate" in m] and len(caplog.messages) == 1  # once
    assert r1.policy == r2.policy == "query_attention" and r1.profile == "none" and r1.band is None
    assert r1.fidelity_budget == DEFAULT_FIDELITY_BUDGET

    n = plan.num_tokens
    band = Band("here", n, (_point(0.0, 0.5), _point(0.2, 0.03), _point(0.6, 0.02)))
    profile = dataclasses.replace(_profile((band,)), model_digest=engine.fingerprint.digest)
    cal = SpanCache(engine, store=plain.store, tokenizer_fingerprint=tok.fingerprint, profile=profile)
    r = cal.assemble(dataclasses.replace(plan, options=ReuseOptions(fidelity_budget=0.05))).report
    assert (r.policy, r.ratio, r.profile, r.band, r.fidelity_budget) == (
        "query_attention", 0.2, profile.id, "here", 0.05)
    assert r.recomputed_tokens > 0
    exact = cal.assemble(dataclasses.replace(plan, options=ReuseOptions(fidelity_budget=0.01))).report
    assert exact.policy == "full" and exact.reused_tokens == 0 and exact.profile == profile.id
    # an explicit policy is never overridden by the profile
    own = cal.assemble(dataclasses.replace(plan, options=ReuseOptions(policy="none", first_k=0))).report
    assert own.policy == "none" and own.profile is None and own.recomputed_tokens == 0


def test_a_request_budget_out_of_range_is_a_422_field_error():
    from contextkit.integrations.edge.parse import reuse_options

    for bad in (0, 1.5, -1):
        with pytest.raises(InputError, match="fidelity_budget"):
            reuse_options({"fidelity_budget": bad})
    assert reuse_options({"fidelity_budget": 0.1}).budget == 0.1
    assert reuse_options({"policy": "query_attention", "attention_budget": 0.2}).attention_budget == 0.2


def test_every_shipped_profile_loads_and_is_named_by_its_id():
    from contextkit.spans.calibration import PACKAGED, packaged_profile

    shipped = sorted(PACKAGED.glob("*.json"))
    assert shipped, "spans/profiles ships the model of record's profile"
    for path in shipped:
        head = json.loads(path.read_text())
        profile = CalibrationProfile.load(path, model_digest=head["model_digest"], dtype=head["dtype"])
        assert path == packaged_profile(profile.model_digest, profile.dtype, profile.kv_source)
        assert path.stem == profile.id
