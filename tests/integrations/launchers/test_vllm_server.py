"""The vLLM launcher's recipe: the dtype it starts vLLM in follows the CPU, as the engine's "auto" does."""

from pathlib import Path

import pytest

import contextkit.core.config as config
from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig


def _dtype_arg(server: VLLMServer) -> str:
    cmd = server.command()
    return cmd[cmd.index("--dtype") + 1]


@pytest.mark.parametrize(("fast_bf16", "want"), [(True, "bfloat16"), (False, "float32")])
def test_auto_starts_vllm_in_bf16_only_where_the_cpu_multiplies_bf16(monkeypatch, fast_bf16, want):
    # vLLM's own default follows the checkpoint (bf16 for SmolLM2): on a CPU without AVX512-BF16 or AMX
    # its linear layers fall back to emulated bf16, ~5x slower than fp32 (DEVELOPERS.md)
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: fast_bf16)
    cfg = VLLMServerConfig(model_dir=Path("/m"))
    assert cfg.dtype == "auto" and cfg.resolved_dtype == want
    assert _dtype_arg(VLLMServer(cfg)) == want


def test_an_explicit_dtype_is_kept_and_a_wrong_one_refused(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    assert _dtype_arg(VLLMServer(VLLMServerConfig(model_dir=Path("/m"), dtype="bfloat16"))) == "bfloat16"
    with pytest.raises(ConfigError, match="dtype must be one of"):
        VLLMServerConfig(model_dir=Path("/m"), dtype="bf16")


@pytest.mark.slow  # a second vLLM server, on Qwen2.5-Coder-0.5B (~2.5 GB of float32 weights)
@pytest.mark.vllm
def test_vllm_cpu_serves_the_prepared_qwen_dir(qwen_dir, tmp_path):
    """The directory `contextkit models prepare qwen2.5-coder-0.5b-instruct` writes loads in vllm-cpu as
    it is (no GGUF kernel asked for, the tokenizer and chat template found) and answers."""
    import httpx

    cfg = VLLMServerConfig(model_dir=qwen_dir, served_name="qwen", max_model_len=2048, kv_cache_gib=1,
                           log_file=tmp_path / "vllm.log")
    with VLLMServer(cfg) as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": "qwen", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        assert "Paris" in body["choices"][0]["text"], body
        assert body["usage"]["prompt_tokens"] == 5
