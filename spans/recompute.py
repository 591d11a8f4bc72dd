"""Selective recomputation: which reused tokens to recompute in their new context.

Reused span KV was computed with each span seeing only itself (and its declared predecessors). Tokens
whose KV would change most by seeing the rest of the context are recomputed; their fresh KV is written
back into the assembled cache by the final forward, which also prefills the query. Policies, one
interface (``select``), chosen per request by ``ReuseOptions.policy``:

- ``none``: recompute nothing (fastest, least faithful).
- ``first_k`` (EPIC): the first k tokens of each non-exact span: they absorb the attention-sink role.
- ``kv_deviation`` (CacheBlend): run every context token through layers 0..check_layer in place (exact
  KV for those layers), rank reused tokens by how far their key at ``check_layer`` moved, keep the
  top r.
- ``query_attention``: prefill the query on top of the reused cache, under the final positions, and
  score every reused token by the attention it receives from the query (probability x value norm,
  summed over heads, the first ``probe_layers`` layers and query tokens); keep the top r (at most
  ``max_recompute`` tokens), or, with ``attention_budget``, the
  fewest tokens such that the share of the query's attention mass left on stale tokens is <= budget.
  That share is the documented deviation estimate: the part of the query's read that still goes
  through KV computed without its new context.
- ``full``: handled by the assembler as a plain prefill.
- ``budget``: resolved by the assembler to one of the above from the model's calibration profile
  (``spans.calibration``) before selection; it never reaches ``select``.

Candidates are reused tokens of non-exact spans only: the first span at position 0 (and a prompt-depend
chain from it) already has exactly the KV a full prefill would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.kvcache import KVCache
from contextkit.core.policy import ReuseOptions


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a plan's tokens sit in the assembled cache (slot order, padding excluded)."""

    ids: torch.Tensor  # (N,) token ids of every non-padding slot, in slot order
    slots: torch.Tensor  # (N,)
    positions: torch.Tensor  # (N,)
    segments: torch.Tensor  # (N,) item index of each token
    item_slots: tuple[torch.Tensor, ...]  # slots of each plan item
    candidates: torch.Tensor  # slots of reused tokens that may be recomputed
    computed: torch.Tensor  # slots always computed in context (query, separators, non-reused items)
    query: torch.Tensor  # slots of the trailing non-reused item(s), the request's query


@dataclass
class Selection:
    slots: torch.Tensor  # reused slots to recompute
    estimated_deviation: float | None = None


def key_shift(stale: torch.Tensor, fresh: torch.Tensor) -> float:
    """How far recomputing moved tokens' keys: the mean over layers, KV heads and tokens of
    ||K_fresh - K_stale|| / ||K_stale||, both ``(layers, kv_heads, tokens, head_dim)``. The tail gate's
    signal (``spans.calibration``): the recomputed tokens stand for the stale ones beside them."""
    stale, fresh = stale.float(), fresh.float()
    return round(float(((fresh - stale).norm(dim=-1) / stale.norm(dim=-1).clamp_min(1e-6)).mean()), 6)


def attention_probs(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Attention weights in float32 as a probe sees them: q (H, rows, D), k (Hkv, T, D) shared by groups
    of heads, mask (rows, T) bool or None -> (H, rows, T)."""
    h, hkv = q.shape[0], k.shape[0]
    kk = k.repeat_interleave(h // hkv, dim=0).float()  # (H, T, D)
    logits = torch.einsum("hrd,htd->hrt", q.float(), kk) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask[None], float("-inf"))
    return logits.softmax(-1)


class _AttentionMass:
    """Probe: attention the query rows give each key slot, weighted by the slot's value norm."""

    def __init__(self, layers: range, cache: KVCache, end: int):
        self.layers = layers
        self.cache = cache
        self.score = torch.zeros(end, dtype=torch.float32)

    def observe(self, layer: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> None:
        h, hkv = q.shape[0], k.shape[0]
        probs = attention_probs(q, k, mask, scale)  # (H, rows, T)
        vnorm = self.cache.v[layer, :, : k.shape[1]].float().norm(dim=-1)  # (Hkv, T)
        vnorm = vnorm.repeat_interleave(h // hkv, dim=0)[:, None, :]
        self.score += (probs * vnorm).sum(dim=(0, 1))


def _top(candidates: torch.Tensor, scores: torch.Tensor, ratio: float, cap: int | None = None) -> torch.Tensor:
    count = int(round(ratio * candidates.numel()))
    if cap is not None:
        count = min(count, cap)
    if count == 0:
        return candidates[:0]
    order = scores[candidates].argsort(descending=True)
    return candidates[order[:count]].sort().values


def select(engine: KVEngine, cache: KVCache, layout: Layout, options: ReuseOptions) -> Selection:
    """Slots of reused tokens to recompute under ``options`` (the cache holds the laid-out spans).

    ``options.first_k`` tokens at the start of every candidate span are added to any policy's choice:
    a span compiled alone turns its first tokens into attention sinks that the new context lacks.
    """
    chosen = _select(engine, cache, layout, options)
    if options.first_k and options.policy != "first_k":
        extra = _first_k(layout, options.first_k)
        chosen.slots = torch.cat([chosen.slots, extra]).unique()
    return chosen


def _first_k(layout: Layout, k: int) -> torch.Tensor:
    cand = layout.candidates
    picked = [s[:k] for s in layout.item_slots if s.numel() and bool(torch.isin(s, cand).all())]
    return torch.cat(picked).sort().values if picked else cand[:0]


def _select(engine: KVEngine, cache: KVCache, layout: Layout, options: ReuseOptions) -> Selection:
    cand = layout.candidates
    policy = options.policy
    if policy == "none" or cand.numel() == 0 or (options.ratio == 0 and options.attention_budget is None
                                                  and policy in ("kv_deviation", "query_attention")):
        return Selection(cand[:0])
    if policy == "first_k":
        return Selection(_first_k(layout, options.first_k))
    if policy == "kv_deviation":
        layer = min(options.check_layer, engine.spec.num_layers - 1)
        before = cache.k[layer].clone()  # (Hkv, slots, D)
        ctx = ~torch.isin(layout.slots, layout.query)
        engine.forward(cache, layout.ids[ctx], positions=layout.positions[ctx], slots=layout.slots[ctx],
                       stop_after=layer + 1)
        end = cache.length  # every candidate slot is below it
        deviation = (cache.k[layer, :, :end] - before[:, :end]).float().norm(dim=-1).sum(0)  # (end,)
        return Selection(_top(cand, deviation, options.ratio, options.max_recompute))
    if policy == "query_attention":
        length = cache.length
        q = layout.query
        idx = torch.isin(layout.slots, q)
        depth = options.probe_layers or engine.spec.num_layers
        depth = min(depth, engine.spec.num_layers)
        probe = _AttentionMass(range(depth), cache, length + q.numel())
        engine.forward(cache, layout.ids[idx], positions=layout.positions[idx], slots=layout.slots[idx],
                       logits="none", probe=probe, stop_after=depth if depth < engine.spec.num_layers else None)
        cache.truncate(length)  # the query is prefilled again after recomputation
        score = probe.score
        total = float(score[:length].sum()) or 1.0
        pool = cand
        if options.first_k:  # the sinks are recomputed anyway: spend the ratio on other tokens
            pool = cand[~torch.isin(cand, _first_k(layout, options.first_k))]
        if options.attention_budget is None:
            picked = _top(pool, score, options.ratio * cand.numel() / max(pool.numel(), 1), options.max_recompute)
        else:
            order = pool[score[pool].argsort(descending=True)]
            stale = float(score[pool].sum()) / total  # share of attention on candidates, none recomputed
            cum = score[order].cumsum(0) / total
            need = int((stale - cum > options.attention_budget).sum()) + (1 if stale > options.attention_budget else 0)
            picked = order[: min(need, order.numel())].sort().values
        # what stays stale: the pool less what was picked (the sinks are recomputed, as in the connector's
        # repair, whose candidates exclude them): the same estimate on both paths
        left = float(score[pool].sum() - score[picked].sum()) / total
        return Selection(picked, estimated_deviation=round(left, 6))
    raise ValueError(f"policy {policy!r} is not a selection policy")  # "full" and "budget" never reach here
