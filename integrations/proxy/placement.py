"""Where a documents request goes and in which order (``place``): each upstream's Weaver may order the
documents differently, so the request is planned once per distinct order and each plan is scored against
the upstream it was made for, by its KV events where it publishes them (``routing.Router``), else by its
Weaver's estimate; beside them, the order the fleet's events hold deepest (``ordering/event_order.py``).
Runs its CPU work on the caller's ``off_loop`` (a planning thread)."""

from __future__ import annotations

import asyncio

from contextkit.core.errors import PromptTooLongError
from contextkit.core.plan import RequestPlan
from contextkit.core.planner import FixedOrder, Planner
from contextkit.integrations.proxy.kv_index import keys_by, prompt_keys
from contextkit.integrations.proxy.relay import Upstreams
from contextkit.integrations.proxy.routing import Choice, Routed
from contextkit.integrations.proxy.upstreams import Upstream
from contextkit.ordering.event_order import SearchLimits, event_order


async def place(ups: Upstreams, planner: Planner, request, salt: str, off_loop,
                session: bytes | None = None) -> tuple[Routed, RequestPlan]:
    """Choose the upstream for a documents request and its plan there. Each upstream's Weaver may order the
    documents differently, so the request is planned once per distinct order and each plan is scored
    against the upstream it was made for: by that upstream's KV events (the blocks it holds under the
    request's ``salt``), else by its Weaver's estimate."""
    pool = ups.pool.healthy()
    if not pool:
        ups.least_loaded()  # raises the 503
    limits = await asyncio.gather(*(ups.model_len(u) for u in pool))
    if len(pool) == 1:
        plan = await off_loop(planner.plan, request, pool[0].weaver, context_limit=limits[0])
        return Routed(Choice(pool[0], "single")), plan
    router = ups.router
    depth = router.depth_reader([router.position(u) for u in pool])
    plans, keys, (alt, alt_keys, search) = await off_loop(plan_each, planner, request, pool, limits, salt=salt,
                                                          depth=depth, search_limits=ups.search_limits)
    if search is not None:
        ups.metrics.event_order(search)
    events, model, scored = {}, {}, {}
    alt_held = router.held(alt_keys) if alt is not None else {}  # the order the fleet's events found
    for at, (u, plan, k) in enumerate(zip(pool, plans, keys)):
        if plan is not None:
            i = router.position(u)
            if k not in scored:  # upstreams whose Weavers chose the same order share one fleet pass
                scored[k] = router.held(k)
            events[i] = scored[k].get(i, 0)
            model[i] = (plan.expected_cached_tokens or 0) // ups.settings.block_size
            if alt_held.get(i, 0) > events[i]:  # used where it holds more than the Weaver's order
                plans[at], keys[at], events[i] = alt, alt_keys, alt_held[i]
    choice = router.pick([u for u, p in zip(pool, plans) if p is not None], events=events, model=model,
                         blocks=max(len(k) for k in keys), session=session)
    at = pool.index(choice.upstream)
    return Routed(choice, keys[at]), plans[at]


def plan_each(planner: Planner, request, pool: list[Upstream], limits: list[int | None], *, salt: str,
              depth=None, search_limits: SearchLimits = SearchLimits()
              ) -> tuple[list[RequestPlan | None], list[tuple[bytes, ...]], tuple]:
    """The request planned with each upstream's Weaver and its prompt's block keys (one plan per distinct
    order and limit), and (plan, keys, search) of the order the fleet's events hold deepest (``depth``: the
    router's reader; None, or no such order: (None, (), the search or None)), searched within
    ``search_limits``. An upstream whose context the prompt does not fit gets None; none fitting raises."""
    made: dict = {}
    plans, keys = [], []
    error = None
    docs = planner.docs(request)
    for u, limit in zip(pool, limits):
        result = u.weaver.order(docs, request.tenant, record=False)
        order = result.order
        if (order, limit) not in made:
            try:  # the Weaver's answer as it gave it (planning with the Weaver would ask it again)
                plan = planner.plan(request, FixedOrder(order, result.reusable_tokens), context_limit=limit)
                made[order, limit] = plan, tuple(prompt_keys(plan.ids, block_size=planner.block_size, salt=salt))
            except PromptTooLongError as exc:
                made[order, limit], error = (None, ()), exc
        plans.append(made[order, limit][0])
        keys.append(made[order, limit][1])
    if all(p is None for p in plans):
        raise error
    alt, search = None, None
    if depth is not None:
        fits = [limit for limit, p in zip(limits, plans) if p is not None]
        limit = min(fits, default=None) if None not in fits else None
        alt, search = event_order(planner, request, depth=depth, block_size=planner.block_size,
                                  keys_of=keys_by(salt=salt, block_size=planner.block_size),
                                  context_limit=limit, limits=search_limits)
    alt_keys = tuple(prompt_keys(alt.ids, block_size=planner.block_size, salt=salt)) if alt is not None else ()
    return plans, keys, (alt, alt_keys, search)
