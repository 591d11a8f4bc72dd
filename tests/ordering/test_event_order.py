"""`ordering.event_order`, the event-driven orderer, and its bounds (issue 46): a 300-document request
the fleet holds in another order is found with two plans and one block hash per candidate, not k(k+1)/2
plans; a limit or the deadline ends the search with the deepest order found so far, or none (the Weaver's
order then stands)."""

from __future__ import annotations

import pytest

from contextkit.core.planner import ChatRequest, FixedOrder, Planner
from contextkit.core.tokenizer import Tokenizer
from contextkit.core.types import Evidence, Message
from contextkit.integrations.proxy.kv_index import BlockIndex, FleetIndex, keys_by, prompt_keys
from contextkit.ordering.event_order import SearchLimits, event_order

BS = 32


class CountingPlanner(Planner):
    """The real planner, counting its plans (what the unbounded search made k(k+1)/2 of)."""

    plans = 0

    def plan(self, *args, **kwargs):
        self.plans += 1
        return super().plan(*args, **kwargs)


@pytest.fixture(scope="module")
def planner(smol_dir):
    return CountingPlanner(Tokenizer(smol_dir), block_size=BS)


def _held(planner, request, order, salt="s"):
    """A fleet of one server that holds ``request``'s prompt in ``order`` (as its events would say), and the
    reader of how deep it holds a prompt."""
    fleet = FleetIndex()
    keys = prompt_keys(planner.plan(request, FixedOrder(order)).ids, block_size=BS, salt=salt)
    BlockIndex(block_size=BS, fleet=fleet, server=0).expect(keys, until=1e12)
    return keys, lambda k: max(fleet.held_prefixes(k).values(), default=0)


def _request(n: int, block_align: bool = False) -> ChatRequest:
    """``n`` passages of ~70 tokens (retrieved passages are longer than a KV block; shorter ones whose first
    tokens match tie, and then cost a scan per tie: module docstring)."""
    words = "archive ledger museum river harbor station library garden tower bridge market valley".split()
    docs = tuple(Evidence(f"Record {i}: " + " ".join(words[(i * k) % len(words)] + str(i * k % 97)
                                                     for k in range(1, 22)), id=f"d{i}") for i in range(n))
    return ChatRequest((Message("user", "Which room holds item 3?"),), docs, ordering="weaver",
                       block_align=block_align)


@pytest.mark.parametrize("block_align", [False, True])
def test_a_300_document_request_held_reversed_is_found_with_two_plans(planner, block_align):
    request = _request(300, block_align)
    reverse = tuple(range(299, -1, -1))
    keys, depth = _held(planner, request, reverse)
    planner.plans = 0
    plan, search = event_order(planner, request, depth=depth, block_size=BS,
                               keys_of=keys_by(salt="s", block_size=BS),
                               limits=SearchLimits(deadline_s=60))
    assert plan.order == reverse and search.outcome == "found"
    assert planner.plans == 2  # the unbounded search planned 45,150 times
    assert search.scores <= 300 * 301 // 2  # one block hash each; most candidates fail on their first block
    assert plan.expected_cached_tokens >= (len(keys) - 2) * BS  # all but the question's blocks


def test_the_score_limit_cuts_the_search_with_the_deepest_order_so_far(planner):
    request = _request(40)
    held_order = tuple(range(39, -1, -1))
    _, depth = _held(planner, request, held_order)
    plan, search = event_order(planner, request, depth=depth, block_size=BS,
                               keys_of=keys_by(salt="s", block_size=BS),
                               limits=SearchLimits(max_scores=100, deadline_s=60))
    assert search.outcome == "cut" and search.scores == 100
    # 40 + 39 candidates scored the first two positions in full: those two are chosen, the rest follow in order
    assert plan.order[:2] == (39, 38) and plan.order[2:] == tuple(range(38))
    assert plan.expected_cached_tokens > 0


def test_a_spent_deadline_gives_no_order_and_the_weavers_stands(planner):
    request = _request(20)
    _, depth = _held(planner, request, tuple(range(19, -1, -1)))
    plan, search = event_order(planner, request, depth=depth, block_size=BS,
                               keys_of=keys_by(salt="s", block_size=BS),
                               limits=SearchLimits(deadline_s=0), clock=iter(range(10**6)).__next__)
    assert plan is None and search.outcome == "cut"


def test_another_tenants_cache_orders_nothing(planner):
    request = _request(30)
    _, depth = _held(planner, request, tuple(range(29, -1, -1)), salt="other-tenant")
    plan, search = event_order(planner, request, depth=depth, block_size=BS,
                               keys_of=keys_by(salt="s", block_size=BS))
    assert plan is None and search.outcome == "none"
