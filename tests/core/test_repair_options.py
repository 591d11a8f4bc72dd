"""``core.repair``: the recompute options a span-reuse request sends through vLLM, and the planned count."""

from __future__ import annotations

import pytest

from contextkit.core.errors import ConfigError
from contextkit.core.plan import ReuseOptions
from contextkit.core.repair import RepairOptions, planned, sinks
from contextkit.core.tenancy import pic_salt


def test_options_round_trip_and_name_their_variant():
    o = RepairOptions(policy="kv_deviation", ratio=0.2, first_k=4)
    assert RepairOptions.of(o.wire()) == o
    assert RepairOptions.of({**o.wire(), "probe_end": 99}).variant == o.variant  # where the probe looks: same KV
    assert RepairOptions(policy="kv_deviation", ratio=0.25, first_k=4).variant != o.variant
    salts = {pic_salt("t", recompute_last=False), pic_salt("t", recompute_last=False, variant=o.variant),
             pic_salt("t", recompute_last=False, variant=RepairOptions().variant)}
    assert len(salts) == 3  # no variant's repaired blocks are a prefix hit for another


@pytest.mark.parametrize("raw, needle", [
    ("x", "must be an object"),
    ({"policy": "attention"}, "does not run inside vLLM"),
    ({"policy": "none"}, "does not run inside vLLM"),
    ({"ratio": 1.5, "policy": "query_attention"}, "ratio"),
    ({"policy": "query_attention", "shuffle": True}, "unknown fields"),
    ({"probe_end": 0}, "probe_end"),
    ({"policy": "budget", "fidelity_budget": 0}, "budget"),
])
def test_bad_options_say_what_is_wrong(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        RepairOptions.of(raw)


def test_from_reuse_maps_the_proxys_options():
    assert RepairOptions.from_reuse(ReuseOptions(policy="none")) is None
    assert RepairOptions.from_reuse(ReuseOptions(policy="full")) is None
    r = RepairOptions.from_reuse(ReuseOptions(policy="query_attention", ratio=0.2, max_recompute=None, first_k=0))
    assert (r.policy, r.ratio, r.max_recompute, r.first_k) == ("query_attention", 0.2, None, 0)
    assert RepairOptions.from_reuse(ReuseOptions()).policy == "budget"


def test_the_planned_count_is_sinks_plus_the_ratios_share():
    pieces = ((10, 50, 0), (60, 40, 0), (100, 30, 12))  # the third starts inside its span: no sinks
    s = sinks(pieces, 2)
    assert s == [10, 11, 60, 61]
    assert planned(policy="query_attention", ratio=0.3, max_recompute=None, candidates=120, sinks=4) == 36
    assert planned(policy="query_attention", ratio=0.3, max_recompute=20, candidates=120, sinks=4) == 20
    assert planned(policy="kv_deviation", ratio=1.0, max_recompute=None, candidates=120, sinks=4) == 116
    assert planned(policy="first_k", ratio=0.3, max_recompute=None, candidates=120, sinks=4) == 0
    assert planned(policy="query_attention", ratio=0.25, max_recompute=None, candidates=10, sinks=0) == 3  # 2.5 up
