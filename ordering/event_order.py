"""Ordering a documents request by what a fleet's caches hold (issue 30; bounded in issue 46).

Each proxy replica's Weaver knows only the orders that replica sent, so a session's next request reaching
another replica (a load balancer in front of several) used to be ordered afresh, and the prompt the
servers hold for it went unused. The servers' events know better: this module orders the documents
greedily, one position at a time, choosing the document with which the rendered prompt's cached prefix
(on the server holding it deepest) goes furthest, the rest following in the client's order, until no
document extends it (the cached prefix ends before this position, or inside the document chosen). It is
a candidate beside each upstream's Weaver order, scored the same way by the caller.

It knows no server and no hash: the caller passes ``keys_of(ids, parent)``, the keys a server names the
full blocks of ``ids`` by when they continue the block keyed ``parent`` (the proxy's is vLLM's chained
block hash under the tenant's salt, ``integrations/proxy/kv_index.prompt_keys``), and ``depth(keys)``, how
many leading blocks of ``keys`` the fleet holds (the proxy's KV-event index).

Cost, bounded: the request is planned twice (once in the client's order, which gives the frame and each
document's rendered tokens, once in the order found); each candidate at a position is scored by hashing
its first block onto the chain of the prefix chosen so far (one blake2b and two dict lookups), and only a
candidate whose first block is held is hashed further. At most ``limits.max_scores`` candidates are
scored and the search stops at ``limits.deadline_s``: then the deepest order found so far is the
candidate (the caller keeps the Weaver's order unless it holds more). It runs on a planning thread and
reads the caller's map only (no writes).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contextkit.core.planner import FixedOrder

KeysOf = Callable[[Sequence[int], "bytes | None"], list[bytes]]  # (ids, parent) -> the keys of ids' full blocks


@dataclass(frozen=True, slots=True)
class SearchLimits:
    """How much one request's search may cost (``ProxySettings.event_order_scores`` / ``_deadline_ms``)."""

    max_scores: int = 50_000  # candidates scored (a 300-document request fully cached in another order: 45k)
    deadline_s: float = 0.25


@dataclass(slots=True)
class Search:
    """What one search did: candidates scored, and how it ended (``found``: an order the fleet holds;
    ``none``: nothing cached beyond the frame, or nothing to order; ``cut``: a limit ended it, the deepest
    order so far is the candidate)."""

    scores: int = 0
    outcome: str = "none"


def event_order(planner, request, *, depth: Callable[[Sequence[bytes]], int], keys_of: KeysOf, block_size: int,
                context_limit: int | None = None, limits: SearchLimits = SearchLimits(),
                clock: Callable[[], float] = time.monotonic):
    """(the plan whose prompt the fleet holds deepest, built greedily (module docstring), or None when no
    document order starts on a cached prefix beyond the frame; the ``Search``). ``depth(keys)``: the most
    leading blocks of ``keys`` any fresh server holds; ``keys_of``: the servers' block keys (module
    docstring)."""
    search = Search()
    n = len(request.documents)
    if n < 2 or request.ordering != "weaver":
        return None, search
    base = planner.plan(request, FixedOrder(tuple(range(n))), context_limit=context_limit)
    at = next(i for i, it in enumerate(base.items) if it.span.kind == "document"
              and it.span.name == base.document_ids[0])
    segs = [tuple(it.span.token_ids) for it in base.items[at : at + n]]  # as rendered (aligned if asked)
    ids = [t for it in base.items[:at] for t in it.span.token_ids]
    keys = keys_of(ids, None)
    if keys and depth(keys) < len(keys):
        return None, search  # the frame itself is not held: no order of the documents is
    chosen, remaining = [], list(range(n))
    deadline = clock() + limits.deadline_s
    whole = True
    while len(remaining) > 1:
        found = _extend(ids, keys, remaining, segs, depth=depth, keys_of=keys_of, block_size=block_size,
                        search=search, limits=limits, deadline=deadline, clock=clock)
        if found is None:
            break
        d, new, whole = found
        chosen.append(d)
        remaining.remove(d)
        ids += segs[d]
        keys += new
        if not whole:  # the cached prefix ends inside this document
            break
    if not chosen:
        return None, search
    held = len(keys)
    if whole:  # the documents that follow in the client's order may be held too (the last one always is)
        full = len(ids) // block_size
        rest = ids[full * block_size :] + [t for r in remaining for t in segs[r]]
        parent = keys[-1] if keys else None
        held += _continues(depth, parent, keys_of(rest, parent))
    if search.outcome != "cut":
        search.outcome = "found"
    order = (*chosen, *remaining)
    return planner.plan(request, FixedOrder(order, held * block_size), context_limit=context_limit), search


def _extend(ids: list[int], keys: list[bytes], remaining: list[int], segs: list[tuple[int, ...]], *, depth,
            keys_of: KeysOf, block_size: int, search: Search, limits: SearchLimits, deadline: float,
            clock) -> tuple[int, list[bytes], bool] | None:
    """The document of ``remaining`` that extends the held prefix ``ids`` (whose full blocks' keys are
    ``keys``, all held) furthest: (its index, the keys of the blocks it completes, whether all of them are
    held); None when none extends it or a limit ended the search (``search.outcome`` then says ``cut``).
    Ties go to the client's order."""
    full = len(ids) // block_size
    tail = ids[full * block_size :]  # a block the next document completes
    parent = keys[full - 1] if full else None
    scored: list[tuple[int, int, list[bytes]]] = []  # (blocks held past the prefix, document, its keys)
    for d in remaining:
        if _spent(search, limits, deadline, clock):
            return None
        run = tail + list(segs[d])
        new = _walk(run, parent, depth=depth, keys_of=keys_of, block_size=block_size)
        if new:
            scored.append((len(new), d, new, len(run) // block_size))
    if not scored:
        return None
    top = max(extra for extra, _, _, _ in scored)
    tied = [(d, new) for extra, d, new, _ in scored if extra == top]
    d, new = tied[0]
    whole = {d_: top == blocks for _, d_, _, blocks in scored}
    if len(tied) > 1 and whole[d]:
        # each ends inside a block the next document completes (documents shorter than a block, or sharing
        # their first blocks): the one after which some document's first block is held goes on
        for d_try, new_try in tied:
            rest = (ids + list(segs[d_try]))[(full + len(new_try)) * block_size :]
            parent_try = new_try[-1] if new_try else parent
            if _next_held(rest, [e for e in remaining if e != d_try], segs, parent_try, depth=depth, keys_of=keys_of,
                          block_size=block_size, search=search, limits=limits, deadline=deadline, clock=clock):
                d, new = d_try, new_try
                break
            if search.outcome == "cut":
                return None
    return d, new, whole[d]


def _walk(run: list[int], parent: bytes | None, *, depth, keys_of: KeysOf, block_size: int) -> list[bytes]:
    """The keys of the leading full blocks of ``run`` (after ``parent``) a fresh server holds, hashed one
    block at a time and stopped at the first it does not (a wrong candidate costs one hash)."""
    held: list[bytes] = []
    for i in range(len(run) // block_size):
        key = keys_of(run[i * block_size : (i + 1) * block_size], held[-1] if held else parent)
        if not _continues(depth, held[-1] if held else parent, key):
            break
        held += key
    return held


def _next_held(rest: list[int], candidates: list[int], segs, parent, *, depth, keys_of, block_size, search,
               limits, deadline, clock) -> bool:
    """Whether the block after ``parent`` that ``rest`` starts is held with some candidate completing it."""
    for e in candidates:
        if _spent(search, limits, deadline, clock):
            return False
        first = keys_of((rest + list(segs[e]))[:block_size], parent)
        if first and _continues(depth, parent, first):
            return True
    return False


def _spent(search: Search, limits: SearchLimits, deadline: float, clock) -> bool:
    """Count one score, or say the search is over (``cut``)."""
    if search.scores >= limits.max_scores or clock() > deadline:
        search.outcome = "cut"
        return True
    search.scores += 1
    return False


def _continues(depth, parent: bytes | None, new: list[bytes]) -> int:
    """How many of ``new`` (the blocks after ``parent``) a fresh server holds, counted on a server that holds
    ``parent`` too. Holding ``parent`` is read as holding the prefix it ends (keys chain the whole prefix;
    a server that evicted an earlier block of it is the rare case, and the caller scores the final order
    over its full prompt before using it)."""
    if parent is None:
        return depth(new)
    return max(depth([parent, *new]) - 1, 0)
