"""Ordering a documents request by what the fleet's KV events say is cached (issue 30).

Each proxy replica's Weaver knows only the orders that replica sent, so a session's next request reaching
another replica (a load balancer in front of several) used to be ordered afresh, and the prompt the
servers hold for it went unused. The servers' events know better: this module orders the documents
greedily, one position at a time, choosing the document with which the rendered prompt's cached prefix
(on the server holding it deepest) goes furthest, the rest following in the client's order, until the
choice at a position no longer changes how far it goes (the cached prefix ends before it). It is a
candidate beside each upstream's Weaver order, scored the same way.

Cost: at most k(k+1)/2 plans and key chains for k documents (a fully cached order is found in the first
pass through the positions); it runs on a planning thread and reads the fleet map only (no writes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from contextkit.core.planner import FixedOrder
from contextkit.integrations.proxy.kv_index import prompt_keys


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
    best, best_order = 0, None
    while len(remaining) > 1:
        tried = []
        for d in remaining:
            order = (*chosen, d, *(r for r in remaining if r != d))
            plan = planner.plan(request, FixedOrder(order), context_limit=context_limit)
            keys = prompt_keys(plan.ids, block_size=block_size, salt=salt)
            tried.append((depth(keys), -len(tried), d, order, len(keys)))
        top, bottom = max(tried), min(tried)
        if top[0] == bottom[0] or top[0] < best:  # the cached prefix ends before this position
            break
        best, _, d, best_order, total = top
        chosen.append(d)
        remaining.remove(d)
        if best == total:  # the whole prompt is cached in this order
            break
    if best_order is None or best == 0:
        return None
    return planner.plan(request, FixedOrder(best_order, best * block_size), context_limit=context_limit)
