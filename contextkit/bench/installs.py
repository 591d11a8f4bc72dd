"""``contextkit bench installs``: each light install as a user makes it, measured.

For each role (``--set roles=proxy,client``) a fresh virtual environment gets the project's own wheel with
that extra only (``pip install 'contextkit-*.whl[proxy]'``, from the package index, as a user installs it).
A row per role: ``install_s`` (pip, wall), ``venv_mb`` (the whole environment on disk, pip included),
``import_s`` (median over ``--set reps`` fresh interpreters of importing the role's entry modules) and
``heavy_imported`` (which of torch, transformers, numpy, vLLM, LMCache that import pulled in: none is the
point). The targets (issue 31): proxy under 300 MB and 0.5 s, client under 80 MB.

The same functions build the venvs ``tests/test_light_installs.py`` runs the proxy and the clients from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median
from contextkit.core.errors import ConfigError

HEAVY = ("torch", "transformers", "numpy", "vllm", "lmcache")
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Role:
    """A light install: the extra it names, the modules its users import first, its size budget."""

    extra: str
    modules: tuple[str, ...]
    budget_mb: float
    import_budget_s: float | None = None


ROLES = {
    "proxy": Role("proxy", ("contextkit.integrations.proxy.app",), budget_mb=300, import_budget_s=0.5),
    "client": Role("client", ("contextkit", "contextkit.sdk.http"), budget_mb=80),
}


@dataclass(frozen=True)
class Install:
    role: Role
    venv: Path
    install_s: float

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.venv / "bin"


def build_wheel(out_dir: Path, *, repo: Path = REPO) -> Path:
    """The project's wheel (no dependencies) built from ``repo`` into ``out_dir``."""
    if not (repo / "pyproject.toml").is_file():
        raise ConfigError(f"{repo} is not a contextkit clone: bench installs builds the wheel from the source "
                          "tree (run it from a clone, installed with `pip install -e`)")
    out_dir.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out_dir), str(repo)],
         what="building the contextkit wheel")
    wheels = sorted(out_dir.glob("contextkit-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise ConfigError(f"pip wheel wrote no contextkit wheel into {out_dir}")
    return wheels[-1]


def install(root: Path, *, role: Role, wheel: Path, python: str | None = None) -> Install:
    """A fresh venv under ``root/<extra>`` holding ``wheel[extra]`` and what that extra needs, nothing else."""
    venv = root / role.extra
    if venv.exists():
        shutil.rmtree(venv)
    base = python or getattr(sys, "_base_executable", sys.executable)
    _run([base, "-m", "venv", str(venv)], what=f"creating the {role.extra} venv")
    t0 = time.perf_counter()
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
          f"{wheel}[{role.extra}]"], what=f"pip install contextkit[{role.extra}]")
    return Install(role, venv, time.perf_counter() - t0)


def venv_mb(venv: Path) -> float:
    """Bytes on disk of every file in the environment (symlinks not followed), in MB."""
    total = sum(p.lstat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())
    return total / 1e6


def import_probe(inst: Install, *, reps: int) -> tuple[float, tuple[str, ...]]:
    """Median seconds of importing the role's modules in a fresh interpreter, and the heavy modules loaded."""
    code = ("import importlib, json, sys, time\n"
            "t = time.perf_counter()\n"
            f"for m in {list(inst.role.modules)!r}: importlib.import_module(m)\n"
            "dt = time.perf_counter() - t\n"
            f"print(json.dumps([dt, sorted(m for m in {list(HEAVY)!r} if m in sys.modules)]))\n")
    times, heavy = [], set()
    for _ in range(reps):
        out = _run([str(inst.python), "-c", code], what="the import probe", cwd=tempfile.gettempdir())
        dt, loaded = json.loads(out.splitlines()[-1])
        times.append(dt)
        heavy.update(loaded)
    return median(times), tuple(sorted(heavy))


def _run(argv: list[str], *, what: str, cwd: str | None = None) -> str:
    # PYTHONPATH and the editable install's finder must not leak the dev tree into the light venv
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd or tempfile.gettempdir(),
                          check=False)  # the caller's message says what failed
    if proc.returncode != 0:
        raise ConfigError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1500:]}")
    return proc.stdout


def _row(inst: Install, reps: int) -> dict[str, Any]:
    import_s, heavy = import_probe(inst, reps=reps)
    size = venv_mb(inst.venv)
    role = inst.role
    return {"name": role.extra, "install_s": round(inst.install_s, 1), "venv_mb": round(size, 1),
            "budget_mb": role.budget_mb, "import_s": round(import_s, 3), "import_budget_s": role.import_budget_s,
            "heavy_imported": ",".join(heavy) or "none",
            "within_budget": size <= role.budget_mb and not heavy
            and (role.import_budget_s is None or import_s <= role.import_budget_s)}


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    names = ctx.option("roles", ("proxy", "client"), lambda s: tuple(x for x in s.split(",") if x))
    unknown = [n for n in names if n not in ROLES]
    if unknown:
        raise ConfigError(f"--set roles: unknown {', '.join(unknown)}; choose from {', '.join(ROLES)}")
    reps = ctx.option("reps", 5, int)
    tick(total=len(names) + 1)
    with tempfile.TemporaryDirectory(prefix="contextkit-installs-") as tmp:
        tick("building the wheel")
        wheel = build_wheel(Path(tmp) / "dist")
        rows = []
        for name in names:
            tick(f"installing contextkit[{name}]")
            rows.append(_row(install(Path(tmp), role=ROLES[name], wheel=wheel), reps))
    summary = {f"{r['name']}_{k}": r[k] for r in rows for k in ("venv_mb", "import_s", "install_s")}
    summary["all_within_budget"] = all(r["within_budget"] for r in rows)
    return BenchResult("installs", {"roles": list(names), "reps": reps, "wheel": wheel.name}, rows, summary)
