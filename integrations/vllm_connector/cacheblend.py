"""CacheBlend through LMCache (0.5.6) + vLLM V1: the config both need, and prompts LMCache can split.

``CacheBlendConfig`` is contextkit's one options object; ``lmcache_settings`` maps it onto LMCache's
keys (and only there), ``vllm_args`` / ``vllm_env`` tell vLLM to load ``LMCacheConnectorV1`` and
LMCache where its YAML is. ``blend_prompt_ids`` joins independently tokenized segments (system prompt,
documents, question) with the separator tokens LMCache splits at. docs/cacheblend.md has the whole story;
this is the ledger of the sharp edges found in the installed code, each handled or refused here:

- Separator: LMCache encodes ``blend_special_str`` with the model's tokenizer and drops the first id,
  assuming it is a BOS (``SegmentTokenDatabase.__init__``: ``encode(s)[1:]``). Tokenizers that add no
  BOS (SmolLM2's, Gemma 3's as prepared here) lose a real token, so ``separator_ids`` returns exactly
  what LMCache matches, never the plain encoding (that would glue one token onto the preceding segment
  and change its key). LMCache splits at *every* occurrence of those ids, so ``blend_prompt_ids``
  refuses a segment that contains them; it also refuses a prompt shorter than the separator, on which
  ``SegmentTokenDatabase._fast_split_by_subtensor`` raises.
- ``use_layerwise``: ``LMCacheConnectorV1Impl.start_load_kv`` calls the blender only when layerwise is
  on. Without it, stored segments are copied into vLLM's cache with no recompute and no RoPE fix-up
  (silently approximate KV), so it is refused. vLLM reads ``use_layerwise`` from
  ``kv_connector_extra_config`` itself (to force PIECEWISE CUDA graphs); LMCache reads only
  ``lmcache.``-prefixed keys there and takes the rest from its YAML, so we set both.
- One check layer, >= 1: ``LMCBlender.process_qkv`` subtracts the full-length stored K from the
  already-reduced K at a second check layer, and at layer 0 K does not depend on context yet (nothing
  to select by). Only ``blend_recompute_ratios[0]`` is read; ``blend_min_tokens`` reaches usage
  telemetry only, not the blender.
- vLLM prefix caching off: ``start_load_kv`` carries "TODO: make prefix caching and blending
  compatible", and LMCache #3229 crashes on that combination.
- Hashes: with ``pre_caching_hash_algorithm: builtin`` segment keys come from Python's per-process salted
  ``hash``; we ask for vLLM's ``sha256_cbor`` so a shared ``remote_url`` hits across processes.
- Upstream, not fixable here: nothing in LMCache 0.5.6 or vLLM 0.32 calls
  ``VLLMModelTracker.register_model``, so building the blender fails at startup unless vLLM is patched;
  the scheduler-side lookup counts only the leading run of stored segments (LMCache #3238); the connector
  keys carry no ``cache_salt`` (#2878). A blending vLLM therefore serves one tenant, and only requests
  that opted in to approximate reuse.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from contextkit.core.config import check_remote_url
from contextkit.core.errors import ConfigError, InputError

__all__ = [
    "DEFAULT_SEPARATOR",
    "LMCACHE_CONNECTOR",
    "SUPPORTED_ARCHITECTURES",
    "CacheBlendConfig",
    "blend_prompt_ids",
    "lmcache_settings",
    "lmcache_yaml",
    "require_cuda",
    "require_supported_model",
    "separator_ids",
    "vllm_args",
    "vllm_env",
    "vllm_transfer_config",
    "write_lmcache_config",
]

DEFAULT_SEPARATOR = " # # "  # LMCache 0.5.6's own default blend_special_str (lmcache/v1/config.py)
LMCACHE_CONNECTOR = "LMCacheConnectorV1"  # vLLM's name; it loads lmcache.integration.vllm.vllm_v1_adapter
# The vLLM model classes LMCache's blender can drive (lmcache/v1/compute/models/utils.py).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_GIB = 1 << 30  # LMCache sizes its CPU pool as int(max_local_cpu_size * 1024**3)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class CacheBlendConfig:
    """CacheBlend settings for one vLLM + LMCache deployment.

    Attributes:
        recompute_ratio: Share of the reused tokens recomputed, in (0, 1] (LMCache picks at least one).
        check_layers: The one layer (>= 1) whose K deviation selects the tokens to recompute.
        min_tokens: LMCache's ``blend_min_tokens`` (0.5.6 reports it in telemetry; the blender ignores it).
        separator: Text whose tokens split a prompt into independently cached segments.
        chunk_size: LMCache's chunk size in tokens (memory layout and mask alignment).
        cpu_bytes: LMCache's CPU pool, in bytes (the pool the layerwise path stages KV through).
        remote_url: Optional shared store: ``lm://host:port`` (lmcache_server) or ``redis://host:port``.
        use_layerwise: Must stay True: LMCache runs the blender only on its layerwise path.
    """

    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    min_tokens: int = 256
    separator: str = DEFAULT_SEPARATOR
    chunk_size: int = 256
    cpu_bytes: int = 5 * _GIB
    remote_url: str | None = None
    use_layerwise: bool = True

    def __post_init__(self) -> None:
        r = self.recompute_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1:  # NaN fails too
            raise ConfigError(f"recompute_ratio must be in (0, 1] (0.15 recomputes 15% of reused tokens), got {r!r}")
        layers = self.check_layers
        if isinstance(layers, list):  # accept a list from a config file; store the hashable form
            layers = tuple(layers)
            object.__setattr__(self, "check_layers", layers)
        if not isinstance(layers, tuple) or len(layers) != 1 or not _is_int(layers[0]) or layers[0] < 1:
            raise ConfigError(
                f"check_layers must name exactly one layer >= 1, e.g. (1,), got {layers!r}: LMCache 0.5.6's blender "
                "breaks at a second check layer (it compares the reduced K with the full stored K), and at layer 0 "
                "K does not depend on the context yet"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ConfigError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if not isinstance(self.separator, str) or not self.separator:
            raise ConfigError(
                f"separator must be a non-empty string such as {DEFAULT_SEPARATOR!r}, got {self.separator!r}"
            )
        if not _is_int(self.chunk_size) or self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be an int > 0 (LMCache's default is 256), got {self.chunk_size!r}")
        if not _is_int(self.cpu_bytes) or self.cpu_bytes <= 0:
            raise ConfigError(f"cpu_bytes must be an int > 0 (e.g. 5 << 30 for 5 GiB), got {self.cpu_bytes!r}")
        if self.remote_url is not None:
            check_remote_url(self.remote_url, alternative=", or None for no shared store")
        if self.use_layerwise is not True:
            raise ConfigError(
                "use_layerwise must be True: LMCache 0.5.6 calls its blender only on the layerwise path "
                "(vllm_v1_adapter.start_load_kv); without it, cached segments are copied in with no recompute "
                "and no RoPE fix-up. To reuse KV without blending, leave CacheBlend off."
            )


def lmcache_settings(cfg: CacheBlendConfig) -> dict[str, Any]:
    """The LMCache 0.5.6 config keys (``lmcache.v1.config``) that turn CacheBlend on for ``cfg``."""
    return {
        "chunk_size": cfg.chunk_size,
        "local_cpu": True,
        "max_local_cpu_size": cfg.cpu_bytes / _GIB,  # GiB; exact for any byte count below 2**53
        "remote_url": cfg.remote_url,
        "use_layerwise": cfg.use_layerwise,
        "enable_blending": True,
        "blend_special_str": cfg.separator,
        "blend_recompute_ratios": [float(cfg.recompute_ratio)],  # a list; the blender reads [0]
        "blend_check_layers": list(cfg.check_layers),
        "blend_min_tokens": cfg.min_tokens,
        "save_unfull_chunk": True,  # LMCache forces this on with blending; say it so the file is the truth
        "pre_caching_hash_algorithm": "sha256_cbor",  # not Python's per-process salted hash()
    }


def lmcache_yaml(cfg: CacheBlendConfig) -> str:
    """``lmcache_settings(cfg)`` as the YAML file ``LMCACHE_CONFIG_FILE`` points to."""
    return yaml.safe_dump(lmcache_settings(cfg), sort_keys=False, default_flow_style=False)


def write_lmcache_config(cfg: CacheBlendConfig, path: str | os.PathLike[str]) -> Path:
    """Write ``lmcache_yaml(cfg)`` to ``path`` atomically (temp file + rename); return its absolute path."""
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(lmcache_yaml(cfg))
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def vllm_transfer_config(cfg: CacheBlendConfig) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that makes vLLM load LMCache's V1 connector for both roles."""
    return {
        "kv_connector": LMCACHE_CONNECTOR,
        "kv_role": "kv_both",  # store what it prefills, load what it finds
        # Read by vLLM itself (LMCacheConnectorV1.requires_piecewise_for_cudagraph): layerwise loads
        # synchronize per layer and cannot be captured in full CUDA graphs.
        "kv_connector_extra_config": {"use_layerwise": cfg.use_layerwise},
    }


def vllm_args(cfg: CacheBlendConfig) -> list[str]:
    """Arguments to append to ``vllm serve`` (e.g. ``VLLMServerConfig.extra_args``).

    ``--no-enable-prefix-caching`` comes last on purpose: argparse keeps the last of a flag pair, so it
    wins over an earlier ``--enable-prefix-caching``. The blender drives vLLM's FlashAttention backend
    (``lmcache.v1.compute.attention.utils``), so the backend is pinned too.
    """
    return [
        "--kv-transfer-config", json.dumps(vllm_transfer_config(cfg), separators=(",", ":")),
        "--attention-backend", "FLASH_ATTN",
        "--no-enable-prefix-caching",
    ]  # fmt: skip


def vllm_env(cfg: CacheBlendConfig, config_path: str | os.PathLike[str]) -> dict[str, str]:
    """Environment for the vLLM process: where LMCache finds its YAML (merge it over ``os.environ``).

    LMCache reads ``LMCACHE_CONFIG_FILE`` once per process (``lmcache_get_or_create_config``); any
    ``LMCACHE_<KEY>`` variable still set overrides the file, so leave those unset.

    Raises:
        ConfigError: ``config_path`` is missing or holds other settings than ``cfg``'s.
    """
    path = Path(config_path).resolve()
    if not path.is_file():
        raise ConfigError(f"LMCache config {path} does not exist; write it first with write_lmcache_config(cfg, path)")
    try:
        found = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read LMCache config {path} ({exc}); rewrite it with write_lmcache_config") from exc
    if found != lmcache_settings(cfg):
        raise ConfigError(
            f"LMCache config {path} holds other settings than this CacheBlendConfig; rewrite it with "
            "write_lmcache_config(cfg, path) so vLLM and contextkit agree on the separator and ratios"
        )
    return {"LMCACHE_CONFIG_FILE": str(path)}


def require_cuda() -> None:
    """Raise unless a CUDA GPU is visible: LMCache 0.5.6 blends on CUDA (or XPU) only.

    Raises:
        ConfigError: ``torch.cuda.is_available()`` is False.
    """
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "CacheBlend needs a CUDA GPU: LMCache 0.5.6 refuses enable_blending on other devices "
            "(lmcache.v1.gpu_connector._validate_vllm_device_features) and its blender runs vLLM's "
            "FlashAttention kernels; torch.cuda.is_available() is False here. Run vLLM + LMCache on a CUDA "
            "machine with a CUDA build of torch, or leave CacheBlend off (contextkit's own span reuse runs on CPU)."
        )


def require_supported_model(model_dir: str | os.PathLike[str]) -> str:
    """The model's architecture, if LMCache's blender can drive it (Llama, Qwen2, Qwen3).

    Raises:
        ConfigError: no readable ``config.json``, or an architecture the blender does not implement.
    """
    cfg_file = Path(model_dir) / "config.json"
    try:
        arch = (json.loads(cfg_file.read_text(encoding="utf-8")).get("architectures") or [""])[0]
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"cannot read the model's architecture from {cfg_file} ({exc}); check model_dir") from exc
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"LMCache 0.5.6's blender supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
            f"{model_dir} is {arch or 'unknown'}. "
            "Serve a supported model, or leave CacheBlend off for this one."
        )
    return arch


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def separator_ids(tokenizer: _Encoder, cfg: CacheBlendConfig) -> list[int]:
    """The token ids LMCache splits prompts at, for this model's tokenizer.

    LMCache computes them as ``tokenizer.encode(separator)[1:]`` (special tokens on, first id dropped as
    if it were a BOS), so this does the same: on a tokenizer that adds no BOS the first real token of the
    separator is not part of it. ``tokenizer`` is ``contextkit.core.tokenizer.Tokenizer`` or a Hugging
    Face tokenizer of the model vLLM serves.

    Raises:
        ConfigError: nothing is left for LMCache to match.
    """
    full = list(tokenizer.encode(cfg.separator, add_special_tokens=True))
    ids = full[1:]
    if not ids:
        raise ConfigError(
            f"separator {cfg.separator!r} encodes to {full} with this tokenizer; LMCache drops the first id "
            "(SegmentTokenDatabase: encode(blend_special_str)[1:]) and would have nothing to split at. "
            f"Use a separator of several tokens, such as {DEFAULT_SEPARATOR!r}."
        )
    return ids


def _occurrences(tokens: Sequence[int], pattern: Sequence[int]) -> list[int]:
    """Every start index of ``pattern`` in ``tokens``, overlapping ones included (as LMCache matches)."""
    m, first, pat = len(pattern), pattern[0], list(pattern)
    return [i for i in range(len(tokens) - m + 1) if tokens[i] == first and list(tokens[i : i + m]) == pat]


def blend_prompt_ids(segments: Sequence[Sequence[int]], separator_ids: Sequence[int]) -> list[int]:
    """Token ids of ``segments`` joined by ``separator_ids``, so that LMCache splits back exactly them.

    Each segment is cached under a key of its own tokens, wherever it sits; put the part that changes
    (the question) last, since LMCache 0.5.6 reuses only the leading run of segments it has stored.

    Args:
        segments: Token ids of each segment (system prompt, documents, question), tokenized apart.
        separator_ids: ``separator_ids(tokenizer, cfg)``.

    Raises:
        ConfigError: ``separator_ids`` is empty.
        InputError: a segment is empty or contains the separator's tokens (LMCache would split there too),
            or the whole prompt is shorter than the separator (LMCache's splitter raises on it).
    """
    sep = list(separator_ids)
    if not sep:
        raise ConfigError("separator_ids is empty; get it from separator_ids(tokenizer, cfg)")
    out: list[int] = []
    starts: list[int] = []  # where each segment starts in ``out``
    for i, seg in enumerate(segments):
        if len(seg) == 0:
            raise InputError(f"segment {i} is empty; drop it before rendering the prompt")
        if i:
            out.extend(sep)
        starts.append(len(out))
        out.extend(seg)
    if len(out) < len(sep):
        raise InputError(
            f"the prompt has {len(out)} tokens, fewer than the separator's {len(sep)}; LMCache 0.5.6 cannot split "
            "it (SegmentTokenDatabase._fast_split_by_subtensor raises), so send it without CacheBlend"
        )
    ours = {s - len(sep) for s in starts[1:]}  # the separators we put in
    stray = [p for p in _occurrences(out, sep) if p not in ours]
    if stray:
        # Blame the segment the stray match starts in, or the next one if it starts inside a separator.
        seg_no = next((k for k in range(len(starts) - 1, -1, -1) if starts[k] <= stray[0]), 0)
        if stray[0] >= starts[seg_no] + len(segments[seg_no]):
            seg_no += 1
        raise InputError(
            f"segment {seg_no} contains (or starts or ends with part of) the blend separator's tokens {sep}; "
            "LMCache would split the prompt there too and cache the wrong segments. Remove the separator text "
            "from the segment, or choose another CacheBlendConfig.separator."
        )
    return out


def refuse_unasked_blend(*, separator: str, separator_ids: Sequence[int], prompt_ids: Sequence[int] | None = None,
                         body: object = None, encode=None) -> None:
    """Refuse a prompt that did not opt in to blending but holds the blend separator.

    A blending upstream blends ANY prompt whose token ids contain ``separator_ids``, opt-in or not: it
    would serve that prompt's segments from KV cached for other prompts (approximate KV the request never
    asked for). Checked on the token ids where the proxy rendered them (``prompt_ids``), else on every
    string of a client's JSON ``body``: its text (the separator, stripped) and its tokens (``encode``;
    a string tokenized alone can differ from the template's tokens at its edges, so both are checked).

    Raises:
        InputError: the prompt holds the separator.
    """
    found = prompt_ids is not None and bool(_occurrences(prompt_ids, separator_ids))
    text = separator.strip() or separator
    stack = [body] if body is not None else []
    while stack and not found:
        v = stack.pop()
        if isinstance(v, str):
            found = text in v or (encode is not None and bool(_occurrences(encode(v), separator_ids)))
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            if v and all(type(x) is int for x in v):  # a prompt given as token ids
                found = bool(_occurrences(v, separator_ids))
            else:
                stack.extend(v)
    if found:
        raise InputError(f"the prompt contains the tokens of {separator!r}, the separator this deployment's "
                         "CacheBlend upstream splits prompts at, so the upstream would serve parts of it from other "
                         "prompts' KV. Remove that text, or opt in to blending with contextkit.reuse on a "
                         "documents request")
