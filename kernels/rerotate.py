"""RoPE re-rotation of cached keys: move keys rotated at positions p to positions q = p + delta.

Rotations compose, so re-rotating is one rotation by ``delta`` per token (``rerotate(rope(k, p), p -> q)
== rope(k, q)``, a tested property). Three paths, one contract:

- ``reference``: pure torch (``kernels/rope.py``), out of place. Ground truth.
- ``cpu``: ``rerotate_cpu.c``, compiled once with the system C compiler and loaded with ctypes; fused,
  one read and one write per element, in place or into a destination (rotate-while-copying, which is
  how spans are laid into a cache). OpenMP over (rows x tokens).
- ``triton``: ``rerotate_triton.py``, for GPUs; tested on CPU with ``TRITON_INTERPRET=1``.

``Rerotator`` picks a path (by config, not env flags), falls back to the reference visibly (logged
once, counted in ``fallbacks``) when the requested path cannot run.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import shutil
import subprocess
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Literal

import torch

from contextkit.kernels.rope import RopeSpec, apply_rope, cos_sin

log = logging.getLogger(__name__)
KernelPath = Literal["auto", "reference", "cpu", "triton"]
_SOURCE = Path(__file__).with_name("rerotate_cpu.c")
_CPU_DTYPES = {torch.float32: "rerotate_f32", torch.bfloat16: "rerotate_bf16", torch.float16: "rerotate_f16"}


def _as_delta(delta: torch.Tensor | int, n: int) -> torch.Tensor:
    d = torch.as_tensor(delta, dtype=torch.long).reshape(-1)
    if d.numel() not in (1, n):
        raise ValueError(f"delta must be a scalar or one value per token ({n}), got {d.numel()} values")
    return d


def rerotate_reference(k: torch.Tensor, delta: torch.Tensor | int, spec: RopeSpec) -> torch.Tensor:
    """Keys ``k`` (..., n, head_dim) rotated by ``delta`` (scalar or (n,)) more positions; new tensor."""
    n = k.shape[-2]
    d = _as_delta(delta, n)
    cos, sin = cos_sin(d, spec, k.dtype)  # (1 or n, D/2), float64 angles
    return apply_rope(k, cos, sin, spec.layout)


def rerotate(k: torch.Tensor, from_pos: torch.Tensor | int, to_pos: torch.Tensor | int, spec: RopeSpec) -> torch.Tensor:
    """Keys rotated at ``from_pos`` re-rotated to ``to_pos`` (reference path; see Rerotator for speed)."""
    return rerotate_reference(k, torch.as_tensor(to_pos) - torch.as_tensor(from_pos), spec)


class _CpuKernel:
    """The compiled C kernel. Built into ``build_dir`` keyed by a hash of source, compiler and flags."""

    FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")

    def __init__(self, build_dir: Path):
        configured = (sysconfig.get_config_var("CC") or "").split()[:1]  # the compiler Python was built with
        cc = next((path for name in [*configured, "gcc", "cc"] if (path := shutil.which(name))), None)
        if cc is None:
            raise RuntimeError("no C compiler found (install gcc) for the fused CPU re-rotation kernel")
        src = _SOURCE.read_bytes()
        tag = hashlib.sha256(src + cc.encode() + " ".join(self.FLAGS).encode()).hexdigest()[:16]
        lib = build_dir / f"rerotate_cpu-{tag}.so"
        if not lib.is_file():
            build_dir.mkdir(parents=True, exist_ok=True)
            tmp = lib.with_suffix(f".{id(self)}.tmp")
            proc = subprocess.run([cc, *self.FLAGS, str(_SOURCE), "-o", str(tmp)], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"compiling {_SOURCE.name} failed: {proc.stderr.strip()[:500]}")
            tmp.replace(lib)  # atomic: a concurrent build never loads half a file
        self._lib = ctypes.CDLL(str(lib))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for name in _CPU_DTYPES.values():
            fn = getattr(self._lib, name)
            fn.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, ctypes.c_int]
            fn.restype = None

    def __call__(self, src: torch.Tensor, dst: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
        # src, dst: (rows, n, D) with last dim contiguous; cos/sin (1 or n, D/2) float32 contiguous
        rows, n, d = src.shape
        fn = getattr(self._lib, _CPU_DTYPES[src.dtype])
        fn(
            src.data_ptr(), dst.data_ptr(), rows, n, d, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
            cos.data_ptr(), sin.data_ptr(), 0 if cos.shape[0] == 1 else cos.stride(0), int(interleaved),
        )


class Rerotator:
    """Re-rotates keys with the chosen kernel path; counts what ran and every fallback.

    Args:
        path: "auto" (cpu kernel for CPU tensors, triton for CUDA, else reference), or one path.
        build_dir: where the CPU kernel's shared library is cached.
    """

    def __init__(self, path: KernelPath = "auto", build_dir: Path | str = Path("~/.cache/contextkit/kernels")):
        if path not in ("auto", "reference", "cpu", "triton"):
            raise ValueError(f"kernel path must be auto, reference, cpu or triton, got {path!r}")
        self.path = path
        self.build_dir = Path(build_dir).expanduser()
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self._cpu: _CpuKernel | None = None
        self._cpu_error: str | None = None
        self._cos_cache: dict[tuple[RopeSpec, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _fallback(self, wanted: str, why: str) -> str:
        if not self.fallbacks[wanted]:
            log.warning("RoPE re-rotation: %s path unavailable (%s); using the torch reference", wanted, why)
        self.fallbacks[wanted] += 1
        return "reference"

    def _choose(self, k: torch.Tensor) -> str:
        wanted = self.path
        if wanted == "auto":
            wanted = "triton" if k.is_cuda else "cpu"
        if wanted == "cpu":
            if k.is_cuda or k.dtype not in _CPU_DTYPES or k.stride(-1) != 1:
                return self._fallback("cpu", f"needs a CPU tensor of {list(_CPU_DTYPES)} with a contiguous last dim")
            if self._cpu is None and self._cpu_error is None:
                try:
                    self._cpu = _CpuKernel(self.build_dir)
                except (RuntimeError, OSError) as exc:
                    self._cpu_error = str(exc)
            if self._cpu is None:
                return self._fallback("cpu", self._cpu_error or "not built")
            return "cpu"
        if wanted == "triton":
            from contextkit.kernels import rerotate_triton

            why = rerotate_triton.unavailable(k)
            return "triton" if why is None else self._fallback("triton", why)
        return "reference"

    def _tables(self, delta: torch.Tensor, spec: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
        if delta.numel() == 1:  # the common case (a whole span moves by one offset): memoise
            key = (spec, int(delta))
            if key not in self._cos_cache:
                if len(self._cos_cache) > 4096:
                    self._cos_cache.clear()
                self._cos_cache[key] = cos_sin(delta, spec, torch.float32)
            return self._cos_cache[key]
        return cos_sin(delta, spec, torch.float32)

    def __call__(
        self, k: torch.Tensor, delta: torch.Tensor | int, spec: RopeSpec, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate ``k`` (..., n, head_dim) by ``delta`` positions into ``out`` (may be ``k``: in place).

        Returns ``out`` (a new tensor if None).
        """
        n = k.shape[-2]
        d = _as_delta(delta, n)
        if out is None:
            out = torch.empty_like(k)
        elif out.shape != k.shape or out.dtype != k.dtype:
            raise ValueError(f"out must match k: {tuple(k.shape)} {k.dtype}, got {tuple(out.shape)} {out.dtype}")
        path = self._choose(k)
        self.calls[path] += 1
        if path == "reference":
            out.copy_(rerotate_reference(k, d, spec))
            return out
        if path == "triton":
            from contextkit.kernels import rerotate_triton

            cos, sin = cos_sin(d, spec, torch.float32)
            rerotate_triton.rerotate_(k, out, cos.to(k.device), sin.to(k.device), spec.layout == "interleaved")
            return out
        try:  # (..., n, D) -> (rows, n, D) without copying; fails only for exotic strides
            src = k.view(-1, n, k.shape[-1])
            dst = out.view(-1, n, out.shape[-1])
        except RuntimeError:
            self.calls["cpu"] -= 1
            self.calls[self._fallback("cpu", "keys whose leading dims cannot be merged without a copy")] += 1
            out.copy_(rerotate_reference(k, d, spec))
            return out
        cos, sin = self._tables(d, spec)
        assert self._cpu is not None
        self._cpu(src, dst, cos, sin, spec.layout == "interleaved")
        return out
