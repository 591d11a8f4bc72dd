"""CacheBlend config for LMCache 0.5.6 + vLLM V1, checked against the installed LMCache and vLLM code.

Everything here runs on CPU and starts no server: LMCache's own config loader, token database and
splitter, and vLLM's own argument parser and connector registry are the oracles. The one GPU test is
skipped where torch sees no CUDA device.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from contextkit.core.errors import ConfigError, InputError
from contextkit.core.tokenizer import Tokenizer
from contextkit.integrations.vllm_connector.cacheblend import (
    DEFAULT_SEPARATOR,
    CacheBlendConfig,
    blend_prompt_ids,
    lmcache_settings,
    lmcache_yaml,
    require_cuda,
    require_supported_model,
    separator_ids,
    vllm_args,
    vllm_env,
    vllm_transfer_config,
    write_lmcache_config,
)

SITE = Path(torch.__file__).resolve().parents[1]  # site-packages of this environment

# Every field away from its default, so that a key LMCache silently ignores shows up as a default value.
CUSTOM = CacheBlendConfig(
    recompute_ratio=0.3, check_layers=(2,), min_tokens=64, separator="\n### ", chunk_size=128,
    cpu_bytes=3 << 30, remote_url="lm://127.0.0.1:65432",
)  # fmt: skip


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"recompute_ratio": 0.0}, "recompute_ratio"),
        ({"recompute_ratio": 1.5}, "recompute_ratio"),
        ({"recompute_ratio": math.nan}, "recompute_ratio"),
        ({"recompute_ratio": True}, "recompute_ratio"),
        ({"recompute_ratio": "0.15"}, "recompute_ratio"),
        ({"check_layers": ()}, "exactly one layer"),
        ({"check_layers": (1, 2)}, "second check layer"),
        ({"check_layers": (0,)}, "layer 0"),
        ({"check_layers": (True,)}, "check_layers"),
        ({"check_layers": ("1",)}, "check_layers"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"separator": ""}, "separator"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 1.5}, "chunk_size"),
        ({"cpu_bytes": 0}, "cpu_bytes"),
        ({"remote_url": "http://host:1"}, "lm://host:port"),
        ({"remote_url": "lm://host"}, "lm://host:port"),
        ({"remote_url": "redis://:6379"}, "redis://host:port"),
        ({"remote_url": "lm://host:port"}, "lm://host:port"),
        ({"use_layerwise": False}, "use_layerwise must be True"),
    ],
)
def test_invalid_settings_raise_config_error_saying_what_to_fix(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        CacheBlendConfig(**kwargs)


def test_valid_settings_are_kept():
    cfg = CacheBlendConfig(recompute_ratio=1, check_layers=[3], remote_url="redis://cache:6379")
    assert cfg.check_layers == (3,)  # a list from a config file becomes the hashable tuple
    assert hash(cfg) == hash(CacheBlendConfig(recompute_ratio=1, check_layers=(3,), remote_url="redis://cache:6379"))
    with pytest.raises(AttributeError):
        cfg.recompute_ratio = 0.5  # frozen


def test_default_separator_is_lmcaches_default():
    """A default config hands LMCache the separator LMCache itself defaults to, so prompts written for
    LMCache's CacheBlend examples split the same way under ours."""
    from lmcache.v1.config import LMCacheEngineConfig

    lmcache_default = LMCacheEngineConfig.from_defaults().blend_special_str
    assert DEFAULT_SEPARATOR == lmcache_default
    ours = LMCacheEngineConfig.from_defaults(**lmcache_settings(CacheBlendConfig()))
    assert ours.blend_special_str == lmcache_default


# ---------------------------------------------------------------- LMCache's config class


def _assert_holds(lm_cfg, cfg: CacheBlendConfig) -> None:
    for key, value in lmcache_settings(cfg).items():
        assert getattr(lm_cfg, key) == value, key
    assert int(lm_cfg.max_local_cpu_size * 1024**3) == cfg.cpu_bytes  # how LMCache sizes its pool


def test_every_key_is_one_lmcache_defines():
    from lmcache.v1.config import LMCacheEngineConfig

    unknown = set(lmcache_settings(CUSTOM)) - set(LMCacheEngineConfig._config_definitions)
    assert not unknown  # from_defaults would drop these silently, from_file with only a warning


def test_lmcache_loads_the_yaml_file_with_every_value(tmp_path):
    from lmcache.v1.config import LMCacheEngineConfig

    path = write_lmcache_config(CUSTOM, tmp_path / "lmcache.yaml")
    assert path.read_text() == lmcache_yaml(CUSTOM)
    loaded = LMCacheEngineConfig.from_file(str(path))
    loaded.validate()
    _assert_holds(loaded, CUSTOM)
    assert loaded.blend_special_str == "\n### "  # leading/trailing whitespace survives the YAML


def test_lmcache_accepts_the_settings_as_keyword_arguments():
    from lmcache.v1.config import LMCacheEngineConfig

    loaded = LMCacheEngineConfig.from_defaults(**lmcache_settings(CUSTOM))
    loaded.validate()
    _assert_holds(loaded, CUSTOM)


def test_vllm_side_loader_reads_the_file_vllm_env_names(tmp_path, monkeypatch):
    """The exact loader LMCacheConnectorV1 runs in each vLLM process (LMCACHE_CONFIG_FILE + env overrides)."""
    from lmcache.integration.vllm import utils as lmc_vllm_utils

    path = write_lmcache_config(CUSTOM, tmp_path / "lmcache.yaml")
    env = vllm_env(CUSTOM, path)
    assert env == {"LMCACHE_CONFIG_FILE": str(path)}
    for name in [n for n in os.environ if n.startswith("LMCACHE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", env["LMCACHE_CONFIG_FILE"])
    monkeypatch.setattr(lmc_vllm_utils, "_config_instance", None)  # a per-process singleton
    _assert_holds(lmc_vllm_utils.lmcache_get_or_create_config(), CUSTOM)


def test_vllm_env_refuses_a_missing_or_stale_file(tmp_path):
    with pytest.raises(ConfigError, match="write_lmcache_config"):
        vllm_env(CUSTOM, tmp_path / "absent.yaml")
    path = write_lmcache_config(CacheBlendConfig(), tmp_path / "lmcache.yaml")
    with pytest.raises(ConfigError, match="other settings"):
        vllm_env(CUSTOM, path)
    path.write_text("enable_blending: [\n")
    with pytest.raises(ConfigError, match="cannot read"):
        vllm_env(CUSTOM, path)


def test_relative_config_path_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_lmcache_config(CUSTOM, "conf/lmcache.yaml")
    assert vllm_env(CUSTOM, "conf/lmcache.yaml")["LMCACHE_CONFIG_FILE"] == str(tmp_path / "conf" / "lmcache.yaml")


# ---------------------------------------------------------------- vLLM side


def test_transfer_config_names_lmcache_connector_for_both_roles():
    ktc = vllm_transfer_config(CacheBlendConfig())
    assert ktc["kv_connector"] == "LMCacheConnectorV1"
    assert ktc["kv_role"] == "kv_both"
    assert ktc["kv_connector_extra_config"] == {"use_layerwise": True}


def test_vllm_parses_the_arguments_and_resolves_the_connector(smol_dir):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    parser = FlexibleArgumentParser()
    AsyncEngineArgs.add_cli_args(parser)
    # What VLLMServer.command() puts first (prefix caching on), then our arguments.
    ns = parser.parse_args(["--model", str(smol_dir), "--enable-prefix-caching", *vllm_args(CacheBlendConfig())])
    args = AsyncEngineArgs.from_cli_args(ns)
    ktc = args.kv_transfer_config
    assert (ktc.kv_connector, ktc.kv_role) == ("LMCacheConnectorV1", "kv_both")
    assert args.enable_prefix_caching is False  # blending and vLLM prefix caching do not mix (LMCache #3229)
    assert AttentionBackendEnum[args.attention_backend] is AttentionBackendEnum.FLASH_ATTN  # a real backend name
    assert KVConnectorFactory.get_connector_class(ktc) is LMCacheConnectorV1
    # vLLM's own check, before LMCache loads: layerwise needs PIECEWISE CUDA graphs.
    assert LMCacheConnectorV1.requires_piecewise_for_cudagraph(ktc.kv_connector_extra_config) is True


# ---------------------------------------------------------------- separator and prompts (real tokenizer)


@pytest.fixture(scope="module")
def tok(smol_dir) -> Tokenizer:
    return Tokenizer(smol_dir)


@pytest.fixture(scope="module")
def lmcache_db(smol_dir, tmp_path_factory):
    """LMCache's own segment database, built from our YAML for the model vLLM would serve."""
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import SegmentTokenDatabase

    path = write_lmcache_config(CacheBlendConfig(), tmp_path_factory.mktemp("lmc") / "lmcache.yaml")
    md = LMCacheMetadata(model_name=str(smol_dir), world_size=1, local_world_size=1, worker_id=0,
                         local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(30, 2, 256, 3, 64))  # fmt: skip
    return SegmentTokenDatabase(LMCacheEngineConfig.from_file(str(path)), md)


def test_separator_ids_are_what_lmcache_matches(tok, lmcache_db):
    ids = separator_ids(tok, CacheBlendConfig())
    assert ids == lmcache_db.sep_tokens.tolist()
    # This tokenizer adds no BOS, so LMCache's [1:] drops a real token: the plain encoding is longer.
    assert tok.encode(DEFAULT_SEPARATOR) != ids


def test_lmcache_uses_a_process_independent_hash(lmcache_db):
    from vllm.utils.hashing import sha256_cbor

    assert lmcache_db.hash_func is sha256_cbor


def test_a_separator_lmcache_cannot_match_is_refused(tok):
    assert tok.encode("#", add_special_tokens=True)  # one token, which LMCache's [1:] drops
    with pytest.raises(ConfigError, match="nothing to split at"):
        separator_ids(tok, CacheBlendConfig(separator="#"))


def test_separator_ids_keep_everything_after_a_bos():
    class WithBos:
        def encode(self, text, add_special_tokens=False):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    assert separator_ids(WithBos(), CacheBlendConfig(separator="ab")) == [97, 98]


def _docs(passage_text: str, n: int) -> list[str]:
    docs = [d for d in passage_text.split("\n\n") if d.strip()][:n]
    assert len(docs) == n
    return docs


def test_lmcache_splits_the_prompt_back_into_the_segments(tok, lmcache_db, passage_text):
    sep = separator_ids(tok, CacheBlendConfig())
    segments = [tok.encode("You answer from the documents.")]
    segments += [tok.encode(d) for d in _docs(passage_text, 4)] + [tok.encode("Who wrote it?")]
    ids = blend_prompt_ids(segments, sep)
    spans = list(lmcache_db.process_tokens(ids, make_key=False))
    assert [ids[s:e] for s, e, _ in spans] == segments
    # Segment keys do not depend on position: the same document hashes the same in another order.
    moved = blend_prompt_ids([segments[0], segments[3], segments[1], segments[2], segments[4], segments[5]], sep)
    by_tokens = {tuple(ids[s:e]): h for s, e, h in spans}
    for s, e, h in lmcache_db.process_tokens(moved, make_key=False):
        assert by_tokens[tuple(moved[s:e])] == h


def test_plain_separator_encoding_would_glue_a_token_onto_segments(tok, lmcache_db, passage_text):
    """Why separator_ids is not tok.encode(separator): LMCache would split one token late."""
    segments = [tok.encode(d) for d in _docs(passage_text, 3)]
    naive = blend_prompt_ids(segments, tok.encode(DEFAULT_SEPARATOR))
    got = [naive[s:e] for s, e, _ in lmcache_db.process_tokens(naive, make_key=False)]
    assert got != segments
    assert got[0] == segments[0] + tok.encode(DEFAULT_SEPARATOR)[:1]


# ---------------------------------------------------------------- blend_prompt_ids, against LMCache's splitter


def _lmcache_split(ids: list[int], sep: list[int]) -> list[list[int]]:
    """LMCache 0.5.6's own splitter (SegmentTokenDatabase._fast_split_by_subtensor) for any separator."""
    from lmcache.v1.token_database import SegmentTokenDatabase

    db = SimpleNamespace(sep_tokens=torch.tensor(sep), sep_len=len(sep))
    return [t.tolist() for t in SegmentTokenDatabase._fast_split_by_subtensor(db, torch.tensor(ids))]


def test_separators_go_between_segments_only():
    assert blend_prompt_ids([[5, 6], [7], [8, 9, 10]], [1, 2]) == [5, 6, 1, 2, 7, 1, 2, 8, 9, 10]
    assert blend_prompt_ids([[5, 6, 7]], [1, 2]) == [5, 6, 7]


@pytest.mark.parametrize(
    ("segments", "sep", "blamed"),
    [
        ([[5, 1, 2, 6], [7]], [1, 2], 0),  # the separator inside a segment
        ([[5], [6], [7, 1, 2]], [1, 2], 2),  # at the end of the last one
        ([[5, 1], [6]], [1, 1], 0),  # 5 1|1 1|6: a match starts in segment 0 and runs into ours
        ([[5], [1, 6]], [1, 1], 1),  # 5|1 1|1 6: a match starts inside ours and runs into segment 1
    ],
)
def test_a_segment_holding_the_separator_is_refused(segments, sep, blamed):
    with pytest.raises(InputError, match=f"segment {blamed} "):
        blend_prompt_ids(segments, sep)
    naive = [t for i, s in enumerate(segments) for t in ([*sep, *s] if i else s)]
    assert _lmcache_split(naive, sep) != segments  # LMCache would indeed cut elsewhere


def test_empty_and_too_short_prompts_are_refused():
    with pytest.raises(InputError, match="segment 1 is empty"):
        blend_prompt_ids([[5], [], [6]], [1, 2])
    with pytest.raises(InputError, match="fewer than the separator"):
        blend_prompt_ids([[5]], [1, 2])
    with pytest.raises(ConfigError):
        blend_prompt_ids([[5]], [])


_seg = st.lists(st.integers(0, 4), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(segments=st.lists(_seg, min_size=1, max_size=5), sep=st.lists(st.integers(0, 4), min_size=1, max_size=3))
def test_refuses_exactly_when_lmcache_would_split_elsewhere(segments, sep):
    naive = [t for i, s in enumerate(segments) for t in ([*sep, *s] if i else s)]
    assume(len(naive) >= len(sep))
    lmcache_recovers = _lmcache_split(naive, sep) == segments
    try:
        ids = blend_prompt_ids(segments, sep)
    except InputError:
        assert not lmcache_recovers
    else:
        assert ids == naive
        assert lmcache_recovers


# ---------------------------------------------------------------- device and model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_require_cuda_explains_cacheblend_needs_a_gpu():
    with pytest.raises(ConfigError, match="CacheBlend needs a CUDA GPU"):
        require_cuda()


def test_lmcache_itself_refuses_blending_off_gpu():
    import lmcache
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import _validate_vllm_device_features

    if lmcache.torch_device_type in ("cuda", "xpu"):
        pytest.skip("LMCache detected a GPU here")
    with pytest.raises(ValueError, match="enable_blending"):
        _validate_vllm_device_features(LMCacheEngineConfig.from_defaults(**lmcache_settings(CacheBlendConfig())))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (LMCache blends on CUDA only)")
def test_on_cuda_lmcache_accepts_the_blend_config(tmp_path):
    """Starts nothing: LMCache's device gate and the blender's hyper-parameters, from our file."""
    from lmcache.v1.compute.blend.metadata import LMCBlendCommonMetadata
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector import _validate_vllm_device_features

    require_cuda()
    loaded = LMCacheEngineConfig.from_file(str(write_lmcache_config(CUSTOM, tmp_path / "lmcache.yaml")))
    _validate_vllm_device_features(loaded)  # raises on a device LMCache cannot blend on
    meta = LMCBlendCommonMetadata(check_layers=loaded.blend_check_layers, recomp_ratios=loaded.blend_recompute_ratios)
    assert meta.check_layers == [2] and meta.recomp_ratios == [0.3]


def test_supported_models(smol_dir, gemma_dir, tmp_path):
    assert require_supported_model(smol_dir) == "LlamaForCausalLM"
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM"):
        require_supported_model(gemma_dir)
    with pytest.raises(ConfigError, match="config.json"):
        require_supported_model(tmp_path)


def test_upstream_still_never_registers_the_model_for_the_blender():
    """Pins a claim of docs/cacheblend.md: without a vLLM patch the blender cannot be built (LMCache #4131).

    If this fails, an upgrade added the registration: update the "upstream state" section.
    """
    callers = [
        str(p.relative_to(SITE))
        for pkg in ("lmcache", "vllm")
        for p in (SITE / pkg).rglob("*.py")
        if "VLLMModelTracker.register_model(" in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert callers == []


def test_yaml_is_plain_data():
    loaded = yaml.safe_load(lmcache_yaml(CUSTOM))
    assert loaded == lmcache_settings(CUSTOM)
    assert json.loads(json.dumps(loaded)) == loaded  # nothing but JSON-compatible values


# -- the proxy with a CacheBlend upstream -----------------------------------------------------------------
def test_proxy_renders_blend_segments_for_requests_that_opt_in(vllm_url, config, app_thread, lmcache_db, tok,
                                                               shared_data):
    """What the proxy sends (vLLM hands the prompt back): LMCache splits it into the planner's segments, the
    system head, each document and the question. Blending itself needs CUDA; the rendering does not."""
    import httpx

    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, timeout_s=60, kv_connector="cacheblend")
    path = shared_data / "multihop_dev.jsonl"
    if path.is_file():
        row = json.loads(path.read_text().splitlines()[0])
        docs = [{"id": p["title"], "text": p["text"]} for p in row["passages"][:3]]
    else:  # a user's clone: the bundled example
        row = json.loads((Path(__file__).parents[3] / "examples" / "question.json").read_text())
        docs = [{"id": str(d.get("id", i)), "text": d["text"]} for i, d in enumerate(row["documents"][:3])]
    body = {"model": "smol", "messages": [{"role": "user", "content": row["question"]}], "documents": docs,
            "max_tokens": 2, "return_token_ids": True, "contextkit": {"reuse": {"policy": "kv_deviation"}}}
    with app_thread(create_app(settings)) as p:
        r = httpx.post(p.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["contextkit"]["reuse"] == {"path": "cacheblend", "segments": 5}  # head, 3 documents, question
        sent = out["choices"][0]["prompt_token_ids"]
        segments = [sent[s:e] for s, e, _ in lmcache_db.process_tokens(sent, make_key=False)]
        assert len(segments) == 5 and all(segments)
        texts = [tok.decode(seg) for seg in segments]
        for d in docs:  # each document is a segment of its own (in the served order)
            assert sum(d["text"][:40] in t for t in texts[1:4]) == 1
        assert row["question"] in texts[-1] and row["question"] not in texts[0]
        plain = httpx.post(p.url + "/v1/chat/completions", json={**body, "contextkit": {}}, timeout=120).json()
        assert len(plain["choices"][0]["prompt_token_ids"]) == len(sent) - 4 * len(lmcache_db.sep_tokens)
        bad = httpx.post(p.url + "/v1/chat/completions", timeout=60,
                         json={**body, "contextkit": {"reuse": {"policy": "kv_deviation", "ratio": 0.3}}})
        assert bad.status_code == 422 and "LMCache config" in bad.json()["error"]["message"]


def test_proxy_refuses_cacheblend_for_several_tenants(config):
    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    settings = ProxySettings(upstreams=["http://127.0.0.1:9"], cache_dir=config.cache_dir, kv_connector="cacheblend",
                             api_keys={"k1": "acme", "k2": "globex"})
    with pytest.raises(ConfigError, match="one tenant"):
        create_app(settings)
