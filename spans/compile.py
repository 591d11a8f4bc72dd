"""Compile a span's KV once, position-free, and lay compiled spans into a cache at new positions."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from contextkit.core.engine import KVEngine
from contextkit.core.kvcache import KVCache
from contextkit.core.tenant import Tenant
from contextkit.core.types import Span
from contextkit.kernels.rerotate import Rerotator
from contextkit.spans.key import ModelIdentity, SpanKey, span_key
from contextkit.spans.store import CompiledSpan


def model_identity(engine: KVEngine, tokenizer_fingerprint: str = "") -> ModelIdentity:
    ropes: list = []
    for layer in engine.spec.layers:
        if layer.rope not in ropes:
            ropes.append(layer.rope)
    return ModelIdentity(
        model=engine.fingerprint.digest,
        tokenizer=tokenizer_fingerprint,
        dtype=str(engine.dtype).removeprefix("torch."),
        rope=tuple(ropes),
    )


def rotate_layers(
    engine: KVEngine, k: torch.Tensor, delta: int, out: torch.Tensor, rerotator: Rerotator
) -> None:
    """Rotate keys (layers, kv_heads, n, D) by ``delta`` positions into ``out``, per layer's RoPE geometry."""
    specs = [layer.rope for layer in engine.spec.layers]
    if all(s == specs[0] for s in specs):  # one geometry (Llama, Qwen): one call over all layers
        rerotator(k, delta, specs[0], out=out)
        return
    for i, spec in enumerate(specs):  # Gemma 3: local and global layers rotate with different bases
        rerotator(k[i], delta, spec, out=out[i])


def write_span(
    engine: KVEngine,
    cache: KVCache,
    span: CompiledSpan,
    slot: int,
    position: int,
    segment: int,
    rerotator: Rerotator,
) -> None:
    """Lay ``span`` into slots ``slot..`` of ``cache`` at positions ``position..`` (rotate while copying)."""
    n = span.num_tokens
    end = slot + n
    if end > cache.capacity:
        raise ValueError(f"span of {n} tokens at slot {slot} overflows a cache of {cache.capacity}")
    rotate_layers(engine, span.k, position, cache.k[:, :, slot:end], rerotator)
    cache.v[:, :, slot:end] = span.v
    cache.positions[slot:end] = torch.arange(position, position + n)
    cache.segments[slot:end] = segment
    cache.length = max(cache.length, end)


def compile_span(
    engine: KVEngine,
    identity: ModelIdentity,
    span: Span,
    rerotator: Rerotator,
    deps: Sequence[CompiledSpan] = (),
    tenant: Tenant | str = "",
) -> CompiledSpan:
    """Run ``span`` through the engine once (after ``deps``, if any) and keep its KV position-free."""
    key: SpanKey = span_key(identity, span.token_ids, tuple(d.key for d in deps), tenant)
    n = len(span.token_ids)
    offset = sum(d.num_tokens for d in deps)
    t0 = time.perf_counter()
    cache = engine.new_cache(offset + n)
    at = 0
    for i, dep in enumerate(deps):
        write_span(engine, cache, dep, at, at, i, rerotator)
        at += dep.num_tokens
    engine.forward(cache, list(span.token_ids), positions=torch.arange(offset, offset + n), logits="none")
    entry = cut_span(engine, cache, key, span.token_ids, torch.arange(offset, offset + n), rerotator)
    return dataclasses.replace(entry, compile_ms=(time.perf_counter() - t0) * 1e3)


def cut_from_context(
    engine: KVEngine, identity: ModelIdentity, spans: Sequence[Span], rerotator: Rerotator, tenant: Tenant | str = ""
) -> list[CompiledSpan]:
    """``spans`` computed in one context, in this order from position 0 (each after those before it), then
    each cut out position-free under its own key: the KV a request that held them leaves behind, which
    vLLM's connector saves for its spans (``context_spans``) and loads wherever they recur. Unlike a span
    compiled alone, each one's KV has seen the spans before it there."""
    n = sum(len(s.token_ids) for s in spans)
    cache = engine.new_cache(n)
    engine.forward(cache, [t for s in spans for t in s.token_ids], positions=torch.arange(n), logits="none")
    out, at = [], 0
    for s in spans:
        m = len(s.token_ids)
        key = span_key(identity, s.token_ids, (), tenant)
        out.append(cut_span(engine, cache, key, s.token_ids, torch.arange(at, at + m), rerotator))
        at += m
    return out


def cut_span(
    engine: KVEngine, cache: KVCache, key: SpanKey, token_ids: Sequence[int], slots: torch.Tensor, rerotator: Rerotator
) -> CompiledSpan:
    """The KV a request computed in ``slots`` (contiguous, consecutive positions), stored position-free
    under ``key``: what a request that reaches the same prefix reuses exactly."""
    lo, hi = int(slots[0]), int(slots[-1]) + 1
    assert hi - lo == len(token_ids) == slots.numel(), "a span's slots are contiguous"
    k = cache.k[:, :, lo:hi].clone()
    start = int(cache.positions[lo])
    if start:
        rotate_layers(engine, k, -start, k, rerotator)  # as if the span started at position 0
    return CompiledSpan(key, tuple(token_ids), k, cache.v[:, :, lo:hi].clone())
