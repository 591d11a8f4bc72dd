"""``core.policy``: the recompute policy's one home: its names and where each runs, the connector's part of
a setting and its salt variant, how "budget" resolves (one function for the built-in engine and the vLLM
connector), the operator's ratio limit, and the count a repair recomputes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from contextkit.core.errors import ConfigError
from contextkit.core.policy import (
    CONNECTOR_POLICIES,
    POLICIES,
    REPAIR_POLICIES,
    Budgets,
    ReuseOptions,
    clamp,
    for_connector,
    planned,
    resolve_budget,
    sinks,
    variant,
)
from contextkit.core.tenancy import pic_salt
from contextkit.integrations.edge.shapes import ReuseIn


def test_every_list_of_policies_is_derived_from_the_one_table():
    assert POLICIES == ("budget", "query_attention", "kv_deviation", "first_k", "none", "full")
    assert REPAIR_POLICIES == ("budget", "query_attention", "kv_deviation", "first_k")
    assert CONNECTOR_POLICIES == POLICIES  # every policy runs through the connector too
    # the HTTP schema takes exactly these names
    assert set(ReuseIn.model_json_schema()["properties"]["policy"]["anyOf"][0]["enum"]) == set(POLICIES)


def test_the_connectors_part_of_a_setting_and_its_salt_variant():
    assert for_connector(ReuseOptions(policy="none")) is None
    assert for_connector(ReuseOptions(policy="full")) is None
    r = for_connector(ReuseOptions(policy="query_attention", ratio=0.2, max_recompute=None, first_k=0,
                                   attention_budget=0.1, recompute_last_span=True, block_size=32))
    assert (r.policy, r.ratio, r.max_recompute, r.first_k) == ("query_attention", 0.2, None, 0)
    assert (r.attention_budget, r.recompute_last_span, r.block_size) == (None, False, 0)  # the built-in engine's
    assert for_connector(ReuseOptions()).policy == "budget"
    o = ReuseOptions(policy="kv_deviation", ratio=0.2, first_k=4)
    assert variant(o) == variant(for_connector(o))
    assert variant(ReuseOptions(policy="kv_deviation", ratio=0.25, first_k=4)) != variant(o)
    assert variant(ReuseOptions(policy="kv_deviation", ratio=0.2, first_k=4, max_recompute=None)) != variant(o)
    salts = {pic_salt("t", recompute_last=False), pic_salt("t", recompute_last=False, variant=variant(o)),
             pic_salt("t", recompute_last=False, variant=variant(ReuseOptions()))}
    assert len(salts) == 3  # no variant's repaired blocks are a prefix hit for another


@dataclass
class _Choice:
    options: ReuseOptions
    band: str
    tail_gate: float | None = 0.4


class _Profile:
    """A profile as the budget sees it: one answer per call, and what it was asked."""

    id = "profile-1"

    def __init__(self, options: ReuseOptions):
        self.options, self.asked = options, []

    def choose(self, budget: float, context_tokens: int) -> _Choice:
        self.asked.append((budget, context_tokens))
        return _Choice(self.options, "long")


def test_budget_resolves_to_the_profiles_choice_or_the_built_in_default():
    asked = ReuseOptions(fidelity_budget=0.05, first_k=3)
    none = resolve_budget(asked, None, 1400)
    assert (none.options.policy, none.options.ratio, none.options.max_recompute) == ("query_attention", 0.3, 512)
    assert (none.profile, none.band, none.budget, none.options.fidelity_budget) == ("none", None, 0.05, None)
    assert none.options.first_k == 3  # the request's sinks stay
    profile = _Profile(ReuseOptions(policy="query_attention", ratio=0.1, max_recompute=None, first_k=2,
                                    probe_layers=4))
    got = resolve_budget(asked, profile, 1400)
    assert profile.asked == [(0.05, 1400)]
    assert (got.options.policy, got.options.ratio, got.options.max_recompute, got.options.probe_layers) == (
        "query_attention", 0.1, None, 4)
    assert (got.profile, got.band, got.tail_gate) == ("profile-1", "long", 0.4)  # the gate goes with the setting
    assert none.tail_gate is None
    assert resolve_budget(ReuseOptions(), _Profile(ReuseOptions(policy="full")), 9).options.policy == "full"
    assert resolve_budget(ReuseOptions(), None, 9).budget == 0.1  # DEFAULT_FIDELITY_BUDGET
    with pytest.raises(ConfigError, match="budget"):
        resolve_budget(ReuseOptions(policy="query_attention"), None, 9)


def test_both_paths_budgets_say_once_that_no_profile_means_the_built_in_default(caplog):
    """The built-in engine's span cache and the connector's scheduler hold one ``Budgets`` each: its
    answers are resolve_budget's, and without a profile the warning comes on the first request only."""
    plain = Budgets(None)
    with caplog.at_level("WARNING", logger="contextkit.core.policy"):
        first, second = (plain.resolve(ReuseOptions(), 1400) for _ in range(2))
    assert first == second == resolve_budget(ReuseOptions(), None, 1400)
    assert [r.message.count("contextkit calibrate") for r in caplog.records] == [1]
    caplog.clear()
    profile = _Profile(ReuseOptions(policy="none"))
    with caplog.at_level("WARNING", logger="contextkit.core.policy"):
        got = Budgets(profile).resolve(ReuseOptions(), 700)
    assert got.options.policy == "none" and got.profile == "profile-1" and not caplog.records


def test_the_operators_ratio_limit_and_types_a_message_may_still_get_wrong():
    o = ReuseOptions(policy="query_attention", ratio=1.0, max_recompute=None)
    assert clamp(o, max_ratio=0.7) == (ReuseOptions(policy="query_attention", ratio=0.7, max_recompute=None),
                                       {"max_recompute_ratio": 0.7})
    assert clamp(ReuseOptions(policy="query_attention", ratio=0.3), max_ratio=0.7)[1] == {}
    for bad in (ReuseOptions(policy="query_attention", first_k=2.5), ReuseOptions(policy="query_attention",
                                                                                 max_recompute=3.0)):
        with pytest.raises(ConfigError, match="integer"):
            clamp(bad, max_ratio=0.7)


def test_the_planned_count_is_sinks_plus_the_ratios_share():
    pieces = ((10, 50, 0), (60, 40, 0), (100, 30, 12))  # the third starts inside its span: no sinks
    s = sinks(pieces, 2)
    assert s == [10, 11, 60, 61]
    assert planned(policy="query_attention", ratio=0.3, max_recompute=None, candidates=120, sinks=4) == 36
    assert planned(policy="query_attention", ratio=0.3, max_recompute=20, candidates=120, sinks=4) == 20
    assert planned(policy="kv_deviation", ratio=1.0, max_recompute=None, candidates=120, sinks=4) == 116
    assert planned(policy="first_k", ratio=0.3, max_recompute=None, candidates=120, sinks=4) == 0
    assert planned(policy="query_attention", ratio=0.25, max_recompute=None, candidates=10, sinks=0) == 3  # 2.5 up
