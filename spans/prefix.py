"""Exact prefix links: span KV computed in place after everything before it, keyed by what came before.

vLLM's automatic prefix caching on span keys: a link's key names the link before it (``chain_key``), so
a hit on a chain of links from position 0 is exactly the KV a full prefill of those spans gives, with
nothing to re-rotate or recompute. ``extend_prefix`` stores a run of spans as links, reusing the links
already stored and computing the rest in place. Requests store links too (``spans.fetch`` looks them
up, ``SpanCache.assemble`` keeps the spans it computed after an exact prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.tenant import Tenant
from contextkit.core.types import Span
from contextkit.kernels.rerotate import Rerotator
from contextkit.spans.compile import cut_span, write_span
from contextkit.spans.key import ModelIdentity, SpanKey, span_key
from contextkit.spans.store import SpanStore


def chain_key(identity: ModelIdentity, item_tokens: tuple[int, ...], prev: SpanKey | None,
              tenant: Tenant | str) -> SpanKey:
    """The key of a span computed in place right after the exact prefix ``prev`` names (None: at 0)."""
    return span_key(identity, item_tokens, (prev,) if prev is not None else (), tenant)


def extend_prefix(
    engine: KVEngine, store: SpanStore, rerotator: Rerotator, identity: ModelIdentity,
    spans: Sequence[Span], tenant: Tenant | str = "",
) -> int:
    """Store ``spans``, laid in order from position 0, as exact prefix links: the links already stored
    are reused, the rest computed in place. Returns the tokens computed."""
    if not spans:
        return 0
    total = sum(len(s.token_ids) for s in spans)
    cache = engine.new_cache(total)
    chain: SpanKey | None = None
    done = at = 0
    for span in spans:  # the longest stored run of links: written as they are, to compute after
        link = chain_key(identity, span.token_ids, chain, tenant)
        entry = store.get(link)
        if entry is None:
            break
        write_span(engine, cache, entry, at, at, 0, rerotator)
        chain, at, done = link, at + entry.num_tokens, done + 1
    rest = spans[done:]
    if not rest:
        return 0
    ids = [t for s in rest for t in s.token_ids]
    engine.forward(cache, ids, positions=torch.arange(at, at + len(ids)), logits="none")
    for span in rest:
        chain = chain_key(identity, span.token_ids, chain, tenant)
        slots = torch.arange(at, at + len(span.token_ids))
        store.put(cut_span(engine, cache, chain, span.token_ids, slots, rerotator))
        at += len(span.token_ids)
    return len(ids)
