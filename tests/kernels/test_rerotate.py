"""Re-rotation kernels against the torch reference: dtypes, both layouts, odd shapes, views, in place."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from contextkit.kernels.rerotate import Rerotator, rerotate, rerotate_reference
from contextkit.kernels.rope import RopeSpec, rope

# max abs error vs the float64 truth, relative to the largest |key|, per storage dtype: the input is
# already rounded to the dtype once and the reference path rounds after each of its ops
TOL = {torch.float32: 3e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}
SPECS = [
    RopeSpec(head_dim=64, base=100000.0),
    RopeSpec(head_dim=64, base=100000.0, layout="interleaved"),
    RopeSpec(head_dim=128, base=500000.0, scaling="llama3", factor=8.0, original_max_positions=8192),
    RopeSpec(head_dim=256, base=1_000_000.0, scaling="linear", factor=2.0),
    RopeSpec(head_dim=6, base=10000.0),  # odd half (3): no vector-width assumptions
]


def _truth(k64: torch.Tensor, pos_from, pos_to, spec: RopeSpec) -> torch.Tensor:
    return rope(k64, torch.as_tensor(pos_to).expand(k64.shape[-2]), spec)


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    r = Rerotator("cpu", build_dir=tmp_path_factory.mktemp("kernels"))
    return r


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.layout}-{s.scaling}-{s.head_dim}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rerotate_moves_keys_to_new_positions(cpu, spec, dtype):
    # rerotate(rope(k, p), p -> q) == rope(k, q) for every path, within the dtype's tolerance
    g = torch.Generator().manual_seed(0)
    k = torch.randn(5, 3, 37, spec.head_dim, generator=g, dtype=torch.float64)
    p = torch.randint(0, 3000, (37,), generator=g)
    q = torch.randint(0, 8000, (37,), generator=g)
    at_p = rope(k, p, spec).to(dtype)
    truth = rope(k, q, spec)
    ref = rerotate(at_p, p, q, spec)
    fused = cpu(at_p, q - p, spec)
    assert cpu.calls["cpu"] > 0 and not cpu.fallbacks
    scale = truth.abs().max().item()
    for got in (ref, fused):
        assert got.dtype == dtype and got.shape == at_p.shape
        assert (got.double() - truth).abs().max().item() <= TOL[dtype] * scale
    # the fused kernel computes in float32: never worse than the reference beyond one rounding
    assert (fused.double() - truth).abs().max() <= (ref.double() - truth).abs().max() + TOL[dtype] * scale / 4


def test_scalar_delta_in_place_into_a_strided_cache_view(cpu):
    spec = RopeSpec(head_dim=64, base=100000.0)
    span = rope(torch.randn(30, 3, 50, 64, dtype=torch.float64), torch.arange(50), spec).float()
    cache = torch.zeros(30, 3, 200, 64)
    dst = cache[:, :, 120:170]  # a slice of a larger cache: non-contiguous, last dim contiguous
    cpu(span, 900, spec, out=dst)  # rotate while copying
    want = rerotate_reference(span, 900, spec)
    assert torch.allclose(cache[:, :, 120:170], want, atol=TOL[torch.float32])
    assert cache[:, :, :120].abs().sum() == 0 and cache[:, :, 170:].abs().sum() == 0  # nothing else touched
    back = cache[:, :, 120:170]
    cpu(back, -900, spec, out=back)  # in place, back to position 0..49
    assert torch.allclose(back, span, atol=1e-5)


def test_unsupported_input_falls_back_visibly(tmp_path, caplog):
    spec = RopeSpec(head_dim=64, base=10000.0)
    k = torch.randn(4, 10, 64, dtype=torch.float64)  # float64: no C kernel for it
    r = Rerotator("cpu", build_dir=tmp_path / "k")
    with caplog.at_level("WARNING", logger="contextkit.kernels.rerotate"):
        for _ in range(3):
            assert torch.allclose(r(k, 5, spec), rerotate_reference(k, 5, spec))
    assert r.fallbacks["cpu"] == 3  # counted every time...
    warned = [rec for rec in caplog.records if "cpu path unavailable" in rec.getMessage()]
    assert len(warned) == 1  # ...logged once


def test_missing_compiler_falls_back_to_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc / gcc on PATH
    monkeypatch.setattr("sysconfig.get_config_var", lambda name: None)
    r = Rerotator("cpu", build_dir=tmp_path / "k")
    spec = RopeSpec(head_dim=16, base=10000.0)
    k = torch.randn(2, 5, 16)
    assert torch.allclose(r(k, 3, spec), rerotate_reference(k, 3, spec))
    assert r.fallbacks["cpu"] == 1 and r.calls["reference"] == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="kernel path"):
        Rerotator("cuda-magic")  # type: ignore[arg-type]
    r = Rerotator("reference")
    with pytest.raises(ValueError, match="delta"):
        r(torch.randn(2, 5, 16), torch.arange(3), RopeSpec(head_dim=16, base=1e4))


TRITON_CHECK = r"""
import torch
from contextkit.kernels.rerotate import Rerotator, rerotate_reference
from contextkit.kernels.rope import RopeSpec
r = Rerotator("triton")
for layout in ("neox", "interleaved"):
    spec = RopeSpec(head_dim=32, base=10000.0, layout=layout)
    for dtype in (torch.float32, torch.bfloat16):
        k = torch.randn(2, 3, 7, 32).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2 * k.abs().max().item()
        for delta in (11, torch.arange(7) * 3 - 5):
            err = (r(k, delta, spec).double() - rerotate_reference(k.double(), delta, spec)).abs().max().item()
            assert err <= tol, (layout, dtype, err)
        view = torch.zeros(2, 3, 20, 32, dtype=dtype)
        r(k, 4, spec, out=view[:, :, 5:12])
        err = (view[:, :, 5:12].double() - rerotate_reference(k.double(), 4, spec)).abs().max().item()
        assert err <= tol and view[:, :, :5].abs().sum() == 0, (layout, dtype, err)
assert r.calls["triton"] == 12 and not r.fallbacks, (r.calls, r.fallbacks)
"""


def test_triton_kernel_in_interpreter_matches_reference():
    pytest.importorskip("triton")
    env = {"TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", TRITON_CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
