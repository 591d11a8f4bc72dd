"""Where a plan's tokens go in the assembled cache: slots and positions per item, then the flat index.

Items take consecutive slots and positions in plan order (``PlanItem.position`` pins a position
instead). With ``block_size`` each reused span starts on a block boundary of slots; the gap is padding,
masked from attention, and takes no positions. ``separator`` tokens go between consecutive reused spans
and are computed in context. ``index`` flattens the placement into the ``Layout`` that selection and
the final forward read, and marks which reused tokens may be recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contextkit.core.plan import RequestPlan
from contextkit.spans.recompute import Layout


@dataclass(frozen=True, slots=True)
class Placed:
    """One run of tokens in the cache: an item's span, or a separator."""

    slot: int
    position: int
    ids: tuple[int, ...]
    reuse: bool
    separator: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    """Every run of a plan, in slot order; ``owner`` is each run's plan item index (-1 = separator)."""

    placed: tuple[Placed, ...]
    owner: tuple[int, ...]
    n_slots: int  # slots the runs span, padding included

    @property
    def last_position(self) -> int:
        return max(p.position + len(p.ids) for p in self.placed)

    @property
    def context_tokens(self) -> int:
        return sum(len(p.ids) for p in self.placed)


def lay_out(plan: RequestPlan) -> Placement:
    """Slots and positions of every item of ``plan``, separators interleaved."""
    opts = plan.options
    placed: list[Placed] = []
    owner: list[int] = []
    slot = position = 0
    prev_reused = False
    for i, item in enumerate(plan.items):
        if item.reuse and prev_reused and opts.separator:
            placed.append(Placed(slot, position, opts.separator, False, True))
            owner.append(-1)
            slot += len(opts.separator)
            position += len(opts.separator)
        if item.reuse and opts.block_size and slot % opts.block_size:
            slot += opts.block_size - slot % opts.block_size
        if item.position is not None:
            position = item.position
        placed.append(Placed(slot, position, item.span.token_ids, item.reuse))
        owner.append(i)
        slot += len(item.span.token_ids)
        position += len(item.span.token_ids)
        prev_reused = item.reuse
    return Placement(tuple(placed), tuple(owner), slot)


def index(plan: RequestPlan, placement: Placement, exact_items: set[int] = frozenset(),
          in_context: set[int] = frozenset()) -> Layout:
    """The flat ``Layout`` of a placement. ``exact_items``: reused items found as exact prefix links;
    ``in_context``: reused items computed in context (like the query) instead."""
    placed, owner = placement.placed, placement.owner
    ids, slots, pos, seg, item_slots = [], [], [], [], [torch.empty(0, dtype=torch.long)] * len(plan.items)
    computed, candidates = [], []
    trailing = len(placed)
    while trailing > 0 and not placed[trailing - 1].reuse:
        trailing -= 1
    query = []
    # a reused item is exact when it was compiled after every earlier item, in place, with
    # nothing computed in between: its KV is what a full prefill gives
    exact_prefix = True
    for j, (p, i) in enumerate(zip(placed, owner)):
        s = torch.arange(p.slot, p.slot + len(p.ids))
        ids.append(torch.tensor(p.ids))
        slots.append(s)
        pos.append(torch.arange(p.position, p.position + len(p.ids)))
        seg.append(torch.full((len(p.ids),), i if i >= 0 else len(plan.items) + j))
        if i >= 0:
            item_slots[i] = s
        if not p.reuse or i in in_context:
            computed.append(s)
            exact_prefix = False
            if j >= trailing:
                query.append(s)
            continue
        item = plan.items[i]
        exact = exact_prefix and (i in exact_items or item.depends_on == tuple(range(i))) and \
            item.position in (None, p.position)
        expected = sum(len(q.ids) for q in placed[:j])
        exact = exact and p.position == expected
        if not exact:
            exact_prefix = False
            candidates.append(s)
    cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.long)
    return Layout(
        ids=cat(ids), slots=cat(slots), positions=cat(pos), segments=cat(seg), item_slots=tuple(item_slots),
        candidates=cat(candidates), computed=cat(computed), query=cat(query),
    )
