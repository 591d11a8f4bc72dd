"""Ordering a documents request by what the fleet's KV events say is cached (issue 30).

Each proxy replica's Weaver knows only the orders that replica sent, so a session's next request reaching
another replica (a load balancer in front of several) used to be ordered afresh, and the prompt the
servers hold for it went unused. The servers' events know better: this module orders the documents
greedily, one position at a time, choosing the document with which the rendered prompt's cached prefix
(on the server holding it deepest) goes furthest, until no choice extends it; the rest keep the
client's order. It is a candidate beside each upstream's Weaver order, scored the same way.

Cost: at most k(k+1)/2 plans and key chains for k documents (a fully cached order is found in the first
pass through the positions); it runs on a planning thread and reads the fleet map only (no writes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contextkit.core.types import OrderResult
from contextkit.integrations.proxy.kv_index import prompt_keys


class Fixed:
    """An orderer (``contextkit.core.planner.Orderer``) that serves one order and records nothing."""

    def __init__(self, order: tuple[int, ...], reusable_tokens: int = 0):
        self._order, self._tokens = order, reusable_tokens

    def order(self, docs: Sequence, tenant=None, record: bool = True) -> OrderResult:
        return OrderResult(self._order, self._tokens, 0, 0.0)

    def record(self, docs: Sequence, tenant=None) -> None:
        pass


def event_order(planner, request, *, depth: Callable[[Sequence[bytes]], int], salt: str | None,
                block_size: int, context_limit: int | None = None):
    """The plan whose prompt the fleet holds deepest, built greedily (module docstring), or None when no
    document order starts on a cached prefix beyond the frame. ``depth(keys)``: the most leading blocks of
    ``keys`` any fresh server holds."""
    n = len(request.documents)
    if n < 2 or request.ordering != "weaver":
        return None
    chosen: list[int] = []
    remaining = list(range(n))
    best, best_plan = 0, None
    while remaining:
        step = None
        for d in remaining:
            order = (*chosen, d, *(r for r in remaining if r != d))
            plan = planner.plan(request, Fixed(order), context_limit=context_limit)
            keys = prompt_keys(plan.ids, block_size=block_size, salt=salt)
            got = depth(keys)
            if got > best and (step is None or got > step[1]):
                step = (d, got, plan, len(keys))
        if step is None:
            break
        chosen.append(step[0])
        remaining.remove(step[0])
        best, best_plan = step[1], step[2]
        if best == step[3]:  # the whole prompt is cached in this order
            break
    if best_plan is None or not chosen:
        return None
    order = (*chosen, *remaining)
    return planner.plan(request, Fixed(order, best * block_size), context_limit=context_limit)
