"""Triton RoPE re-rotation (GPU path). One program per (row, token); float32 math, any storage dtype.

Tested on CPU against the torch reference with ``TRITON_INTERPRET=1`` (triton's interpreter), which is
how CI exercises it on machines without a GPU.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: pip install triton
    triton = None
    tl = None


def unavailable(k: torch.Tensor) -> str | None:
    """Why the Triton path cannot run on ``k`` (None if it can)."""
    if triton is None:
        return "triton is not installed (pip install triton)"
    if not k.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA tensor (or TRITON_INTERPRET=1 to run in triton's interpreter)"
    if k.stride(-1) != 1:
        return "needs a contiguous last dimension"
    return None


if triton is not None:

    @triton.jit
    def _rerotate_kernel(
        src, dst, cos, sin, n, src_row, src_tok, dst_row, dst_tok, cs_stride,
        HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
    ):
        pid = tl.program_id(0)
        r = pid // n
        t = pid % n
        i = tl.arange(0, BLOCK)
        m = i < HALF
        c = tl.load(cos + t * cs_stride + i, mask=m, other=1.0)
        s = tl.load(sin + t * cs_stride + i, mask=m, other=0.0)
        so = src + r * src_row + t * src_tok
        do = dst + r * dst_row + t * dst_tok
        if INTERLEAVED:
            i1 = 2 * i
            i2 = 2 * i + 1
        else:
            i1 = i
            i2 = i + HALF
        x1 = tl.load(so + i1, mask=m).to(tl.float32)
        x2 = tl.load(so + i2, mask=m).to(tl.float32)
        tl.store(do + i1, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=m)
        tl.store(do + i2, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=m)


def rerotate_(k: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> None:
    """Rotate ``k`` (..., n, D) into ``out`` (may alias ``k``); cos/sin (1 or n, D/2) float32."""
    assert triton is not None
    n, d = k.shape[-2], k.shape[-1]
    src = k.view(-1, n, d)
    dst = out.view(-1, n, d)
    rows = src.shape[0]
    half = d // 2
    cs_stride = 0 if cos.shape[0] == 1 else cos.stride(0)
    _rerotate_kernel[(rows * n,)](
        src, dst, cos.contiguous(), sin.contiguous(), n, src.stride(0), src.stride(1), dst.stride(0),
        dst.stride(1), cs_stride, HALF=half, BLOCK=triton.next_power_of_2(half), INTERLEAVED=interleaved,
    )
