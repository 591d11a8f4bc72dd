"""Rotary position embedding: the pure-torch reference every other RoPE path is tested against.

Angles are computed in float64 and only then cast to the working dtype: float32 angles drift to ~4e-4
rad at 8k positions, which is larger than the error budget of re-positioning cached keys.

Two layouts exist in the wild:
- ``neox``: the head dim is split in halves, pair i is (x[i], x[i + d/2]) (Llama, Qwen, Gemma in HF form).
- ``interleaved``: pair i is (x[2i], x[2i + 1]) (GPT-J, original Meta checkpoints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

RopeLayout = Literal["neox", "interleaved"]
RopeScaling = Literal["none", "linear", "llama3"]


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Everything that determines a RoPE rotation besides the position.

    Part of every span key: two models that differ in any field give different rotated keys.
    """

    head_dim: int
    base: float
    layout: RopeLayout = "neox"
    scaling: RopeScaling = "none"
    factor: float = 1.0
    # llama3 scaling only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"RoPE head_dim must be a positive even number, got {self.head_dim}")
        if self.base <= 0:
            raise ValueError(f"RoPE base must be positive, got {self.base}")
        if self.layout not in ("neox", "interleaved"):
            raise ValueError(f"RoPE layout must be 'neox' or 'interleaved', got {self.layout!r}")
        if self.scaling not in ("none", "linear", "llama3"):
            raise ValueError(
                f"RoPE scaling {self.scaling!r} is not supported; supported: none, linear, llama3"
            )


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Inverse frequencies, float64, shape (head_dim // 2,)."""
    dim = spec.head_dim
    freq = 1.0 / (spec.base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if spec.scaling == "linear":
        return freq / spec.factor
    if spec.scaling == "llama3":
        low_wavelen = spec.original_max_positions / spec.low_freq_factor
        high_wavelen = spec.original_max_positions / spec.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / spec.factor, freq)
        smooth = (spec.original_max_positions / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq


def cos_sin(
    positions: torch.Tensor, spec: RopeSpec, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for ``positions``, each (n, head_dim // 2), cast to ``dtype``.

    Positions may be any integers (negative included, for rotating backwards).
    """
    angles = positions.to(torch.float64)[:, None] * inv_freq(spec).to(positions.device)[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout = "neox"
) -> torch.Tensor:
    """Rotate ``x`` (..., n, head_dim) by per-token angles given as cos/sin (n, head_dim // 2).

    Returns a new tensor; the math is done in x's dtype, as the engines do.
    """
    if layout == "neox":
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """Rotate ``x`` (..., n, head_dim) to ``positions`` (n,) under ``spec``."""
    cos, sin = cos_sin(positions, spec, x.dtype)
    return apply_rope(x, cos, sin, spec.layout)
