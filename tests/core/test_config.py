"""The one config object: dtype "auto" resolves by what the CPU multiplies in hardware."""

from __future__ import annotations

import pytest

from contextkit.core.config import ContextKitConfig, cpu_has_fast_bf16, resolve_dtype
from contextkit.core.errors import ConfigError


def test_auto_is_bf16_only_where_the_cpu_has_bf16_instructions(tmp_path):
    with_bf16 = tmp_path / "amx"
    with_bf16.write_text("flags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile\n")
    without = tmp_path / "plain"
    without.write_text("flags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert cpu_has_fast_bf16(with_bf16) and not cpu_has_fast_bf16(without)
    assert not cpu_has_fast_bf16(tmp_path / "missing")  # not Linux: float32
    assert resolve_dtype("auto") == ("bfloat16" if cpu_has_fast_bf16() else "float32")


def test_config_holds_the_resolved_dtype_and_refuses_unknown_ones():
    assert ContextKitConfig().dtype in ("bfloat16", "float32")
    assert ContextKitConfig(dtype="float32").dtype == "float32"
    with pytest.raises(ConfigError, match="auto, float32, bfloat16"):
        ContextKitConfig(dtype="fp8")
