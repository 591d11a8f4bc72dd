"""ModelSpec: the architecture facts the built-in engine needs, parsed from a Hugging Face config.json.

One frozen object per model; everything that changes the math of a forward pass is a field here, so a
model fingerprint can be derived from it. Architectures differ only in these fields, not in code paths:

| family  | q/k norm | norm weight | act        | embed scale    | per-layer rope / window |
|---------|----------|-------------|------------|----------------|-------------------------|
| llama   | no       | w           | silu       | 1              | no                      |
| qwen2   | no       | w           | silu       | 1              | no                      |
| qwen3   | yes      | w           | silu       | 1              | no                      |
| gemma3  | yes      | 1 + w       | gelu(tanh) | sqrt(hidden)   | yes (sliding / full)    |

Linear biases (Qwen2's q/k/v bias) are read from the weights, not from the config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextkit.core.errors import UnsupportedModelError
from contextkit.kernels.rope import RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3")


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Per-layer attention geometry (differs across layers only on Gemma 3)."""

    rope: RopeSpec
    sliding_window: int | None  # None = full attention


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    norm_eps: float
    max_positions: int
    layers: tuple[LayerSpec, ...]
    qk_norm: bool
    norm_offset: float  # RMSNorm multiplies by (norm_offset + weight): 0 for Llama, 1 for Gemma
    activation: str  # "silu" or "gelu_tanh"
    embed_scale: float
    attn_scale: float
    tie_embeddings: bool
    sandwich_norms: bool  # Gemma: extra norms after attention and around the MLP
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim


def _rope_spec(params: dict[str, Any], head_dim: int) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    if rope_type == "default":
        return RopeSpec(head_dim=head_dim, base=base)
    if rope_type == "linear":
        return RopeSpec(head_dim=head_dim, base=base, scaling="linear", factor=float(params["factor"]))
    if rope_type == "llama3":
        return RopeSpec(
            head_dim=head_dim,
            base=base,
            scaling="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_positions=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(
        f"RoPE type {rope_type!r} is not supported by the built-in engine (supported: default, linear, "
        "llama3); use a model without it or serve it through vLLM"
    )


def _rope_params(cfg: dict[str, Any], layer_type: str | None) -> dict[str, Any]:
    """rope parameters in transformers>=5 form (``rope_parameters``) or the older flat keys."""
    params = cfg.get("rope_parameters")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        if layer_type == "sliding_attention" and "rope_local_base_freq" in cfg:
            params = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
        return params
    if layer_type is not None and layer_type in params:
        return params[layer_type]
    return params


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def spec_from_config(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelSpec:
    """Build a ModelSpec from a parsed config.json (and optional generation_config.json)."""
    if "text_config" in cfg:  # multimodal wrappers (Gemma3ForConditionalGeneration): use the text tower
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type", cfg["model_type"])}
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported by the built-in engine; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    gemma = model_type.startswith("gemma3")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    n_layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
    if len(layer_types) != n_layers:
        raise UnsupportedModelError(
            f"config lists {len(layer_types)} layer_types for {n_layers} layers; the config is inconsistent"
        )
    layers = []
    for layer_type in layer_types:
        per_type = layer_type if gemma else None
        window = cfg.get("sliding_window") if layer_type == "sliding_attention" else None
        if not gemma and cfg.get("use_sliding_window") and window is not None:
            raise UnsupportedModelError("sliding-window Qwen configs are not supported by the built-in engine")
        layers.append(LayerSpec(rope=_rope_spec(_rope_params(cfg, per_type), head_dim), sliding_window=window))
    gen = generation_cfg or {}
    eos = _ids(gen.get("eos_token_id", cfg.get("eos_token_id")))
    if gemma:
        act, scale = "gelu_tanh", float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5
    else:
        act, scale = "silu", head_dim**-0.5
    if not gemma and cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {cfg.get('hidden_act')!r} is not supported (expected silu)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            raise UnsupportedModelError(f"{key} is not supported by the built-in engine")
    return ModelSpec(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        norm_eps=float(cfg["rms_norm_eps"]),
        max_positions=int(cfg.get("max_position_embeddings", 2048)),
        layers=tuple(layers),
        qk_norm=gemma or model_type == "qwen3",
        norm_offset=1.0 if gemma else 0.0,
        activation=act,
        embed_scale=hidden**0.5 if gemma else 1.0,
        attn_scale=scale,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        sandwich_norms=gemma,
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", cfg.get("bos_token_id")),
    )


def load_spec(model_dir: Path) -> ModelSpec:
    """Read ``config.json`` (and ``generation_config.json`` if present) from a model directory."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise UnsupportedModelError(
            f"{model_dir} has no config.json; point at a prepared model directory "
            "(`contextkit models prepare`) or a Hugging Face checkpoint directory"
        )
    cfg = json.loads(cfg_path.read_text())
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return spec_from_config(cfg, gen)
