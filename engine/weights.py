"""Load a Hugging Face checkpoint directory into the engine's fused weight layout.

q/k/v projections are concatenated into one matrix and gate/up into another, so a layer does three big
matmuls instead of six small ones. Norm weights are stored ready to multiply: Gemma's ``1 + w`` is folded
in at load time and kept in float32 (Gemma normalises in float32 and casts after scaling).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from contextkit.core.errors import CorruptModelError
from contextkit.core.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class Norm:
    """RMSNorm parameters. ``upcast`` = multiply in float32 before casting (Gemma) instead of after."""

    weight: torch.Tensor  # (dim,)
    eps: float
    upcast: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.upcast:
            return (normed * self.weight).to(x.dtype)
        return self.weight * normed.to(x.dtype)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    attn_norm: Norm
    wqkv: torch.Tensor  # (q_dim + 2 * kv_dim, hidden)
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # (hidden, q_dim)
    bo: torch.Tensor | None
    q_norm: Norm | None  # over head_dim, before RoPE (Qwen3, Gemma 3)
    k_norm: Norm | None
    post_attn_norm: Norm | None  # Gemma sandwich norm
    mlp_norm: Norm
    wgu: torch.Tensor  # (2 * intermediate, hidden): gate rows then up rows
    wdown: torch.Tensor  # (hidden, intermediate)
    post_mlp_norm: Norm | None


@dataclass(frozen=True, slots=True)
class Weights:
    embed: torch.Tensor  # (vocab, hidden)
    layers: tuple[LayerWeights, ...]
    final_norm: Norm
    lm_head: torch.Tensor  # (vocab, hidden); the same storage as embed when tied


def _read_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise CorruptModelError(
                f"{path} is missing; re-run `contextkit models prepare` or point at a complete checkpoint"
            )
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError) as exc:
            raise CorruptModelError(
                f"cannot read {path} ({exc}); delete {model_dir} and run `contextkit models prepare` again"
            ) from exc
    return state


def load_weights(model_dir: Path, spec: ModelSpec, dtype: torch.dtype) -> Weights:
    """Read the safetensors in ``model_dir`` and lay them out for the engine in ``dtype``."""
    state = _read_state_dict(model_dir)
    prefix = "model." if "model.embed_tokens.weight" in state else ""

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        tensor = state.pop(prefix + name, None)
        if tensor is None and required:
            raise CorruptModelError(
                f"weight {prefix + name} is missing from {model_dir}; the checkpoint does not match its "
                "config.json. Re-run `contextkit models prepare`."
            )
        return tensor

    def norm(name: str, dim: int) -> Norm:
        w = take(name)
        assert w is not None and w.shape == (dim,), f"{name}: expected ({dim},), got {tuple(w.shape)}"
        if spec.norm_offset:
            return Norm((w.float() + spec.norm_offset).contiguous(), spec.norm_eps, upcast=True)
        return Norm(w.to(dtype).contiguous(), spec.norm_eps, upcast=False)

    def cat(*tensors: torch.Tensor | None) -> torch.Tensor | None:
        if all(t is None for t in tensors):
            return None
        if any(t is None for t in tensors):
            raise CorruptModelError(f"{model_dir}: some of q/k/v carry a bias and some do not")
        return torch.cat([t.to(dtype) for t in tensors if t is not None]).contiguous()

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        attn = p + "self_attn."
        mlp = p + "mlp."
        wqkv = cat(take(attn + "q_proj.weight"), take(attn + "k_proj.weight"), take(attn + "v_proj.weight"))
        assert wqkv is not None and wqkv.shape == (spec.q_dim + 2 * spec.kv_dim, spec.hidden_size)
        bo = take(attn + "o_proj.bias", required=False)
        layers.append(
            LayerWeights(
                attn_norm=norm(p + "input_layernorm.weight", spec.hidden_size),
                wqkv=wqkv,
                bqkv=cat(
                    take(attn + "q_proj.bias", False),
                    take(attn + "k_proj.bias", False),
                    take(attn + "v_proj.bias", False),
                ),
                wo=take(attn + "o_proj.weight").to(dtype).contiguous(),
                bo=None if bo is None else bo.to(dtype),
                q_norm=norm(attn + "q_norm.weight", spec.head_dim) if spec.qk_norm else None,
                k_norm=norm(attn + "k_norm.weight", spec.head_dim) if spec.qk_norm else None,
                post_attn_norm=(
                    norm(p + "post_attention_layernorm.weight", spec.hidden_size) if spec.sandwich_norms else None
                ),
                mlp_norm=norm(
                    p + ("pre_feedforward_layernorm.weight" if spec.sandwich_norms
                         else "post_attention_layernorm.weight"),
                    spec.hidden_size,
                ),
                wgu=cat(take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")),  # type: ignore[arg-type]
                wdown=take(mlp + "down_proj.weight").to(dtype).contiguous(),
                post_mlp_norm=(
                    norm(p + "post_feedforward_layernorm.weight", spec.hidden_size) if spec.sandwich_norms else None
                ),
            )
        )
    embed = take("embed_tokens.weight").to(dtype).contiguous()
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is None:
        if not spec.tie_embeddings:
            raise CorruptModelError(f"{model_dir} has no lm_head.weight and does not tie embeddings")
        lm_head = embed
    else:
        lm_head = lm_head.to(dtype).contiguous()
    return Weights(embed=embed, layers=tuple(layers), final_norm=norm("norm.weight", spec.hidden_size), lm_head=lm_head)
