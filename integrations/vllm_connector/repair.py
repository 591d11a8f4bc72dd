"""Selective recompute inside a stock vLLM: the worker repairs loaded span KV before vLLM's forward reads it.

A pic request's spans are loaded from position-free KV, re-rotated to their places (``worker.py``). Each
span's KV was computed with the span alone, so every token's KV lacks what came before it in this
prompt. vLLM can only compute one contiguous suffix after an external hit, so it cannot recompute
scattered tokens; the connector can, because it writes the paged cache before the forward that reads it
(``start_load_kv``). ``Repairer.run`` does, for one load:

1. lays out, in a cache of the built-in engine, the request's local prefix (read back from vLLM's paged
   cache) and the loaded region (the re-rotated span KV), as ``spans.assemble`` does for ``serve``;
2. selects the tokens to recompute with the request's policy (``spans.recompute.select``: the question's
   attention through the first layers, or the K deviation at a check layer), plus each span's first
   tokens (sinks); how many is fixed by the scheduler side (``RepairPlan.count``, reported to the client);
3. recomputes them in their new context (forwards over the scattered rows, each attending causally
   to everything before it), and hands the repaired region back to be written into vLLM's cache. The
   rows run in position order, at most ``chunk_tokens`` a forward: a row attends only to rows before it,
   which an earlier chunk has already recomputed through every layer, so the chunks give the KV one
   forward over all of them gives, with the forward's activations bounded.

vLLM then computes the question and decodes over the repaired KV. The KV is still approximate: the
request runs under its own salt namespace (``core.tenancy.pic_salt`` with the setting's variant) and
nothing of it is saved.

The engine is contextkit's own (``contextkit.engine``: the same weights, loaded from vLLM's model
directory into this worker on the first repair; SmolLM2-135M in bf16: ~270 MB of weights plus its
float32 output head, 113 MB). It is the one place outside ``serve`` that builds the built-in engine
(pyproject's import contract names it); the selection talks to it through ``core.engine.KVEngine``.
Models it cannot run exactly like vLLM (sliding-window attention) are refused here (``RepairUnsupported``)
and the worker leaves the span region to vLLM (a full prefill of it, counted).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from contextkit.integrations.vllm_connector.metadata import RepairPlan


class RepairUnsupported(Exception):
    """This model cannot be repaired here (the reason is the message)."""


class TailEscalated(Exception):
    """The repair moved the keys it recomputed further than the profile's tail gate (``RepairPlan.tail_gate``,
    ``spans.recompute.key_shift``): the request looks like the tail its setting does not hold the budget on,
    so nothing is written and vLLM computes the region."""


class Repairer:
    """Recomputes a load's selected tokens with the built-in engine (module docstring).

    Args:
        model_dir: vLLM's model directory (config.json and safetensors).
        dtype: vLLM's model dtype name ("bfloat16", "float16", "float32"): the engine runs in it.
        chunk_tokens: rows recomputed per forward at most (``ConnectorSettings.repair_chunk_tokens``).
    """

    def __init__(self, *, model_dir: Path | str, dtype: str, chunk_tokens: int = 512):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.model_dir, self.dtype, self.chunk_tokens = Path(model_dir), dtype, chunk_tokens
        self._engine = None
        self._refused: str | None = None  # why this model cannot be repaired, once found
        self._lock = threading.Lock()

    def engine(self):
        """The engine, loaded once (``warm`` at the server's start); a model it refuses is refused again at
        once, never loaded a second time."""
        with self._lock:
            if self._refused is not None:
                raise RepairUnsupported(self._refused)
            if self._engine is None:
                from contextkit.engine.model import Engine  # the contract's one named exception (docstring)

                engine = Engine.from_dir(self.model_dir, dtype=self.dtype)
                if any(layer.sliding_window for layer in engine.spec.layers):
                    self._refused = ("sliding-window attention is not repaired here: the span region is computed "
                                     "by vLLM")
                    raise RepairUnsupported(self._refused)
                self._engine = engine
        return self._engine

    @torch.inference_mode()
    def warm(self) -> None:
        """Load the engine and run one short forward, at the server's start: the first request's repair then
        pays neither the weights' load (~0.25 s here) nor the first forward's one-time costs."""
        engine = self.engine()
        cache = engine.new_cache(16)
        engine.forward(cache, list(range(16)), logits="none")

    @torch.inference_mode()
    def run(self, plan: RepairPlan, *, start: int, end: int, prefix: tuple[torch.Tensor, torch.Tensor] | None,
            k: torch.Tensor, v: torch.Tensor) -> int:
        """Repair the loaded region ``start..end`` in place and return the tokens recomputed.

        Args:
            plan: from the scheduler side (what to select, how many).
            prefix: K and V of tokens ``0..start`` already in vLLM's cache, ``(layers, kv_heads, start,
                head_size)`` each (None when ``start`` is 0).
            k, v: the region's re-rotated K and V, ``(layers, tokens, kv_heads, head_size)``: overwritten
                with the repaired KV.
        """
        from contextkit.spans.recompute import Layout, key_shift, select

        engine = self.engine()
        ids = torch.tensor(plan.ids, dtype=torch.long)
        total = ids.numel()
        cache = engine.new_cache(total)
        if start:
            cache.k[:, :, :start], cache.v[:, :, :start] = prefix
        cache.k[:, :, start:end] = k.transpose(1, 2)
        cache.v[:, :, start:end] = v.transpose(1, 2)
        cache.positions[:end] = torch.arange(end)
        cache.segments[:end] = 0
        cache.length = end

        slots = torch.arange(total)
        pieces = tuple(torch.arange(dst, dst + n) for dst, n, _ in plan.pieces)
        cand = torch.cat(pieces) if pieces else slots[:0]
        sinks = torch.tensor(plan.sinks, dtype=torch.long)
        pool = cand[~torch.isin(cand, sinks)]
        chosen = sinks
        if plan.count:
            query = slots[end:]
            layout = Layout(ids=ids, slots=slots, positions=slots, segments=torch.zeros_like(slots),
                            item_slots=pieces, candidates=pool, computed=query, query=query)
            picked = select(engine, cache, layout, _options(plan, pool.numel()))
            cache.truncate(end)
            chosen = torch.cat([chosen, picked.slots])
        chosen = chosen.unique()  # sorted: the chunks go in position order (module docstring)
        stale = cache.k[:, :, chosen].clone() if plan.tail_gate is not None and chosen.numel() else None
        for at in range(0, chosen.numel(), self.chunk_tokens):
            part = chosen[at : at + self.chunk_tokens]
            engine.forward(cache, ids[part], positions=part, slots=part, logits="none")
        if stale is not None and (shift := key_shift(stale, cache.k[:, :, chosen])) > plan.tail_gate:
            raise TailEscalated(f"the repair moved the recomputed keys by {shift:.4f}, over the profile's tail gate "
                                f"{plan.tail_gate:.4f}")
        k.copy_(cache.k[:, :, start:end].transpose(1, 2))
        v.copy_(cache.v[:, :, start:end].transpose(1, 2))
        return int(chosen.numel())


def _options(plan: RepairPlan, pool: int):
    """The selection's options: exactly ``plan.count`` of the ``pool`` non-sink candidates (the sinks are
    added by the caller, so ``first_k`` is 0 here)."""
    from contextkit.core.policy import ReuseOptions

    return ReuseOptions(policy=plan.policy, ratio=plan.count / max(pool, 1), max_recompute=None, first_k=0,
                        probe_layers=plan.probe_layers, check_layer=plan.check_layer)
