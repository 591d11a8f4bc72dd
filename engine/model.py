"""The built-in engine: a plain PyTorch forward for Llama-family models with an explicit KV cache.

``Engine.forward`` prefills any tokens at any per-token positions into a caller-owned ``KVCache`` under
an explicit attention structure (see ``kvcache.py``) and returns the logits asked for. Decoding is the
same call with one token. Every KV-path feature (span reuse, recompute, synthesis) is built on it.

Shapes in comments: n = new tokens, T = filled slots after the write, H / Hkv = query / kv heads,
D = head dim.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from contextkit.core.config import cpu_has_fast_bf16
from contextkit.core.engine import AttentionProbe, LogitsSelect, ModelFingerprint
from contextkit.core.errors import ConfigError, KVCacheError, PromptTooLongError
from contextkit.core.kvcache import Attend, KVCache, attention_mask, causal_mask
from contextkit.core.models import weights_digest
from contextkit.core.spec import ModelSpec, load_spec
from contextkit.engine.weights import Weights, load_weights
from contextkit.kernels.rope import RopeSpec, apply_rope, cos_sin

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger(__name__)


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


class Engine:
    """A loaded model. Stateless across calls: all sequence state lives in the KVCache passed in.

    The one implementation of ``contextkit.core.engine.KVEngine`` (what the span cache talks to)."""

    def __init__(self, spec: ModelSpec, weights: Weights, dtype: torch.dtype, fingerprint: ModelFingerprint):
        self.spec = spec
        self.weights = weights
        self.dtype = dtype
        self.fingerprint = fingerprint
        # Logits in float32 for a bf16/fp16 engine: a half-precision output projection rounds logits of
        # ~20 to steps of 0.125, so near-ties of the next token become exact ties that two numerically
        # different paths (span reuse vs prefill) break differently. Costs a float32 copy of the head
        # (SmolLM2: 113 MB) and ~1.4 ms per decoded token here.
        self._head32 = weights.lm_head.float() if dtype != torch.float32 else None

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: str | torch.dtype = "float32") -> Engine:
        """Load a prepared model directory (config.json + safetensors)."""
        model_dir = Path(model_dir)
        spec = load_spec(model_dir)
        torch_dtype = parse_dtype(dtype)
        if torch_dtype == torch.bfloat16 and not cpu_has_fast_bf16():
            log.warning("bfloat16 on a CPU without AVX512-BF16 or AMX-BF16 runs emulated: matrix products "
                        "measured ~100x slower than float32 on an AVX2-only AMD EPYC; use dtype \"auto\" "
                        "(float32 here) unless you need bf16's numbers")
        fingerprint = ModelFingerprint(spec.model_type, weights_digest(model_dir))
        return cls(spec, load_weights(model_dir, spec, torch_dtype), torch_dtype, fingerprint)

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for up to ``capacity`` tokens, in this engine's dtype."""
        if capacity > self.spec.max_positions:
            raise PromptTooLongError(
                f"a cache of {capacity} tokens exceeds the model's context of {self.spec.max_positions}; "
                "shorten the prompt or lower max_new_tokens"
            )
        s = self.spec
        return KVCache.allocate(s.num_layers, s.num_kv_heads, s.head_dim, capacity, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        token_ids: torch.Tensor | list[int],
        positions: torch.Tensor | Sequence[int] | None = None,
        segment: int | torch.Tensor = 0,
        attend: Attend | None = None,
        logits: LogitsSelect = "last",
        slots: torch.Tensor | Sequence[int] | None = None,
        stop_after: int | None = None,
        probe: AttentionProbe | None = None,
    ) -> torch.Tensor | None:
        """Run ``token_ids`` through the model, writing their KV into ``cache``.

        Args:
            cache: its filled slots ``0..cache.length`` are attended to (causally, by slot order).
            token_ids: (n,) token ids.
            positions: (n,) logical RoPE positions; default continues from ``cache.next_position``.
            segment: segment id for every new token, or (n,) ids; used only with ``attend``.
            attend: segment -> segments it sees fully (see kvcache.py); None = causal over all slots.
            logits: "last" -> (1, vocab), "all" -> (n, vocab), "none" -> None, or a tensor of indices
                into the new tokens -> (len(indices), vocab). Logits are float32.
            slots: write into these slots instead of appending: existing slots are overwritten (selective
                recomputation), slots from ``cache.length`` on are appended. Needs ``positions``.
            stop_after: run only the first ``stop_after`` layers (their KV is written); returns None.
            probe: observes the attention of the new tokens at ``probe.layers``.

        If this raises, the cache length is unchanged; slots overwritten in place hold undefined KV.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise KVCacheError("forward() needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size:
            raise KVCacheError(f"token ids must be in [0, {self.spec.vocab_size}); got {ids.min()}..{ids.max()}")
        pos = self._positions(cache, n, positions, slots)
        if cache.k.dtype != self.dtype or cache.k.shape[0] != self.spec.num_layers:
            raise KVCacheError("this cache was allocated for another model or dtype; use Engine.new_cache()")
        if stop_after is not None and not 0 < stop_after <= self.spec.num_layers:
            raise KVCacheError(f"stop_after must be in 1..{self.spec.num_layers}, got {stop_after}")

        keep = self._kept_rows(logits, n, stop_after)

        where, q_slots, end = self._place(cache, n, slots)
        cache.positions[where] = pos
        cache.segments[where] = torch.as_tensor(segment, dtype=torch.long)
        try:
            x = self._layers(ids, pos, cache, where, q_slots, end, attend, keep, stop_after, probe)
        except BaseException:
            if isinstance(where, slice):
                cache.positions[where] = -1  # appended slots: forget them
            raise
        cache.length = end
        if stop_after is not None or (keep is not None and keep.numel() == 0):
            return None
        w = self.weights
        if self._head32 is not None:
            return F.linear(w.final_norm(x.float()), self._head32)
        return F.linear(w.final_norm(x), w.lm_head)

    def _positions(
        self, cache: KVCache, n: int, positions: torch.Tensor | Sequence[int] | None,
        slots: torch.Tensor | Sequence[int] | None,
    ) -> torch.Tensor:
        """(n,) RoPE positions of the new tokens: as given, or continuing the cache; checked against the context."""
        if positions is None:
            if slots is not None:
                raise KVCacheError("forward(slots=...) needs explicit positions")
            pos = torch.arange(n, dtype=torch.long) + cache.next_position
        else:
            pos = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
            if pos.numel() != n:
                raise KVCacheError(f"{n} tokens but {pos.numel()} positions")
        if int(pos.min()) < 0 or int(pos.max()) >= self.spec.max_positions:
            raise PromptTooLongError(
                f"position {int(pos.max())} is outside the model's context of {self.spec.max_positions} tokens; "
                "shorten the prompt or lower max_new_tokens"
            )
        return pos

    @staticmethod
    def _kept_rows(logits: LogitsSelect, n: int, stop_after: int | None) -> torch.Tensor | None:
        """Rows whose final hidden state is needed (None: all). The last layer runs attention and MLP only
        for them: its K/V (all that later tokens read) come from the layer's input, so skipping the other
        rows there is exact and saves ~1/num_layers of a prefill."""
        if isinstance(logits, str):
            if logits not in ("last", "all", "none"):
                raise KVCacheError(f"logits must be 'last', 'all', 'none' or an index tensor, got {logits!r}")
            keep = None if logits == "all" else torch.arange(n - 1, n) if logits == "last" else torch.arange(0)
        else:
            keep = torch.as_tensor(logits, dtype=torch.long).reshape(-1) % n
        if stop_after is not None:
            keep = None
        return keep

    @staticmethod
    def _place(
        cache: KVCache, n: int, slots: torch.Tensor | Sequence[int] | None
    ) -> tuple[slice | torch.Tensor, torch.Tensor, int]:
        """Where the new tokens go: (index for the cache's slot dim, (n,) slot ids, new cache length)."""
        if slots is None:
            start, end = cache.reserve(n)
            return slice(start, end), torch.arange(start, end), end
        q = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        if q.numel() != n:
            raise KVCacheError(f"{n} tokens but {q.numel()} slots")
        if int(q.min()) < 0 or q.unique().numel() != n:
            raise KVCacheError("slots must be distinct and non-negative")
        fresh = q[q >= cache.length].sort().values
        if fresh.numel() and not torch.equal(fresh, torch.arange(cache.length, cache.length + fresh.numel())):
            raise KVCacheError(f"new slots must continue the cache without gaps from slot {cache.length}")
        _, end = cache.reserve(fresh.numel())
        if torch.equal(q, torch.arange(int(q[0]), int(q[0]) + n)):
            return slice(int(q[0]), int(q[0]) + n), q, end
        return q, q, end

    def _layers(
        self,
        ids: torch.Tensor,
        pos: torch.Tensor,
        cache: KVCache,
        where: slice | torch.Tensor,
        q_slots: torch.Tensor,
        end: int,
        attend: Attend | None,
        keep: torch.Tensor | None,
        stop_after: int | None,
        probe: AttentionProbe | None,
    ) -> torch.Tensor:
        """Hidden states after the last layer: (n, hidden), or (len(keep), hidden) for ``keep`` rows."""
        s, w = self.spec, self.weights
        n = ids.numel()
        x = F.embedding(ids, w.embed)  # (n, hidden)
        if s.embed_scale != 1.0:
            x = x * torch.tensor(s.embed_scale, dtype=self.dtype)
        # cos/sin and masks depend only on the layer's geometry: compute once per distinct geometry
        tables: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        masks: dict[int | None, torch.Tensor | None] = {}
        for layer in s.layers:
            if layer.rope not in tables:
                tables[layer.rope] = cos_sin(pos, layer.rope, self.dtype)
            if layer.sliding_window not in masks:
                masks[layer.sliding_window] = attention_mask(cache, q_slots, end, attend, layer.sliding_window)

        # Rows scattered over the cache (selective recomputation) see different key ranges: attention
        # runs per chunk of rows over only the keys the chunk may see (exact: the cut keys are masked
        # for every row of the chunk). A masked SDPA call otherwise scores every row against every key.
        chunks = {w: _row_chunks(m) for w, m in masks.items()}

        last = s.num_layers - 1
        n_layers = s.num_layers if stop_after is None else stop_after
        for i, (lw, layer) in enumerate(zip(w.layers[:n_layers], s.layers[:n_layers])):
            h = lw.attn_norm(x)
            qkv = F.linear(h, lw.wqkv, lw.bqkv)  # (n, (H + 2 Hkv) D)
            q, k, v = qkv.split((s.q_dim, s.kv_dim, s.kv_dim), dim=-1)
            k = k.view(n, s.num_kv_heads, s.head_dim)
            if lw.k_norm is not None:
                k = lw.k_norm(k)
            cos, sin = tables[layer.rope]
            cache.k[i, :, where] = apply_rope(k.transpose(0, 1), cos, sin, layer.rope.layout)  # (Hkv, n, D)
            cache.v[i, :, where] = v.view(n, s.num_kv_heads, s.head_dim).transpose(0, 1)
            mask = masks[layer.sliding_window]
            is_causal = mask is None and n > 1  # mask None: full causal prefill, or one query seeing all
            rows, q_at = n, q_slots
            if i == last and keep is not None:
                if keep.numel() == 0:
                    return x[:0]
                chunks = {w: None for w in chunks}  # the kept rows: one call
                q, x, cos, sin, rows, q_at = q[keep], x[keep], cos[keep], sin[keep], keep.numel(), q_slots[keep]
                if mask is not None:
                    mask = mask[keep]
                elif is_causal:  # the fast path's implicit mask, made explicit for the kept rows
                    mask, is_causal = causal_mask(q_at, end), False
            q = q.reshape(rows, s.num_heads, s.head_dim)
            if lw.q_norm is not None:
                q = lw.q_norm(q)
            q = apply_rope(q.transpose(0, 1), cos, sin, layer.rope.layout)  # (H, rows, D)
            keys, values = cache.k[i, :, :end], cache.v[i, :, :end]  # (Hkv, T, D)
            if probe is not None and i in probe.layers:
                explicit = causal_mask(q_at, end) if is_causal else mask
                probe.observe(i, q, keys, explicit, s.attn_scale)
            o = self._attention(q, keys, values, mask, is_causal, chunks[layer.sliding_window])  # (H, rows, D)
            a = F.linear(o.transpose(0, 1).reshape(rows, s.q_dim), lw.wo, lw.bo)
            if lw.post_attn_norm is not None:
                a = lw.post_attn_norm(a)
            x = x + a
            h = lw.mlp_norm(x)
            gate, up = F.linear(h, lw.wgu).chunk(2, dim=-1)
            act = F.silu(gate) if s.activation == "silu" else F.gelu(gate, approximate="tanh")
            m = F.linear(act * up, lw.wdown)
            if lw.post_mlp_norm is not None:
                m = lw.post_mlp_norm(m)
            x = x + m
        return x

    def _attention(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        chunks: list[tuple[slice, int, int]] | None,
    ) -> torch.Tensor:
        """SDPA of q (H, rows, D) over keys/values (Hkv, T, D) -> (H, rows, D), per row chunk if given."""
        s = self.spec
        gqa = s.num_heads != s.num_kv_heads
        if chunks is None or mask is None:
            return F.scaled_dot_product_attention(
                q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, is_causal=is_causal,
                scale=s.attn_scale, enable_gqa=gqa,
            )[0]
        out = q.new_empty(q.shape)
        for rows, lo, hi in chunks:
            out[:, rows] = F.scaled_dot_product_attention(
                q[:, rows].unsqueeze(0), keys[:, lo:hi].unsqueeze(0), values[:, lo:hi].unsqueeze(0),
                attn_mask=mask[rows, lo:hi], scale=s.attn_scale, enable_gqa=gqa,
            )[0]
        return out


ROW_CHUNK = 128  # rows per attention call for scattered rows; fewer calls cost Python, more save little


def _row_chunks(mask: torch.Tensor | None) -> list[tuple[slice, int, int]] | None:
    """Row chunks of ``mask`` (rows, T) with the key range [lo, hi) each may see; None: one call is best."""
    if mask is None or mask.shape[0] < 2 * ROW_CHUNK:
        return None
    out, saved = [], 0
    for start in range(0, mask.shape[0], ROW_CHUNK):
        rows = slice(start, min(start + ROW_CHUNK, mask.shape[0]))
        cols = mask[rows].any(0).nonzero()
        if cols.numel() == 0:  # rows that see nothing: let SDPA give what it gives for them, as before
            return None
        lo, hi = int(cols[0]), int(cols[-1]) + 1
        saved += mask.shape[1] - (hi - lo)
        out.append((rows, lo, hi))
    # worth it only when the chunks skip a real share of the keys
    return out if saved * 4 >= mask.shape[1] * len(out) else None
