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
