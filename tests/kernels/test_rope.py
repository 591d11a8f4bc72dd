"""The RoPE reference: against transformers' implementation, across layouts, scalings and dtypes."""

from __future__ import annotations

import pytest
import torch

from contextkit.kernels.rope import RopeSpec, apply_rope, cos_sin, inv_freq, rope

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _hf_inv_freq(spec: RopeSpec) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params: dict = {"rope_type": spec.scaling if spec.scaling != "none" else "default", "rope_theta": spec.base}
    if spec.scaling == "linear":
        params["factor"] = spec.factor
    if spec.scaling == "llama3":
        params.update(factor=spec.factor, low_freq_factor=spec.low_freq_factor,
                      high_freq_factor=spec.high_freq_factor,
                      original_max_position_embeddings=spec.original_max_positions)
    cfg = LlamaConfig(hidden_size=spec.head_dim * 4, num_attention_heads=4, head_dim=spec.head_dim,
                      rope_parameters=params)
    if spec.scaling == "none":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)[0]
    return ROPE_INIT_FUNCTIONS[spec.scaling](cfg)[0]


SPECS = [
    RopeSpec(head_dim=64, base=100000.0),
    RopeSpec(head_dim=128, base=500000.0, scaling="llama3", factor=8.0, original_max_positions=8192),
    RopeSpec(head_dim=32, base=10000.0, scaling="linear", factor=4.0),
]


@pytest.mark.parametrize("spec", SPECS, ids=["default", "llama3", "linear"])
def test_inv_freq_matches_transformers(spec):
    ours = inv_freq(spec)
    ref = _hf_inv_freq(spec).double()
    assert ours.dtype == torch.float64
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)


def test_neox_matches_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    spec = RopeSpec(head_dim=64, base=10000.0)
    x = torch.randn(1, 3, 50, 64, dtype=torch.float64)
    pos = torch.arange(50) * 7
    cos, sin = cos_sin(pos, spec, torch.float64)
    ref, _ = apply_rotary_pos_emb(x, x, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    assert torch.allclose(apply_rope(x, cos, sin, "neox"), ref, atol=1e-12)


def test_interleaved_is_neox_on_permuted_dims():
    spec_n = RopeSpec(head_dim=16, base=10000.0, layout="neox")
    spec_i = RopeSpec(head_dim=16, base=10000.0, layout="interleaved")
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    pos = torch.arange(9) + 3
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])  # interleaved -> half-split
    assert torch.allclose(rope(x, pos, spec_i)[..., perm], rope(x[..., perm], pos, spec_n), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["neox", "interleaved"])
def test_rotations_compose(dtype, layout):
    # rope(rope(k, p), q - p) == rope(k, q): the property span re-positioning relies on.
    spec = RopeSpec(head_dim=64, base=100000.0, layout=layout)
    k = torch.randn(3, 37, 64, dtype=torch.float64)
    p = torch.randint(0, 4000, (37,))
    q = torch.randint(0, 8000, (37,))
    once = rope(k.to(dtype), q, spec)
    twice = rope(rope(k.to(dtype), p, spec), q - p, spec)
    assert torch.allclose(twice.double(), once.double(), atol=ATOL[dtype] * 4)
    # and float64 angles keep fp32 exact even at large offsets
    if dtype == torch.float32:
        assert (twice - once).abs().max().item() < 1e-5


def test_invalid_spec_says_what_is_wrong():
    with pytest.raises(ValueError, match="even"):
        RopeSpec(head_dim=63, base=10000.0)
    with pytest.raises(ValueError, match="scaling"):
        RopeSpec(head_dim=64, base=10000.0, scaling="yarn")  # type: ignore[arg-type]
