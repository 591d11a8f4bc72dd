"""Check the layer contracts in pyproject.toml with import-linter (``lint-imports``).

import-linter finds a package's modules by walking its directory, and contextkit's subpackages live in
root folders mapped into the ``contextkit`` namespace by pyproject's ``package-dir``. So the check runs on
a mirror: a temporary ``contextkit/`` holding copies of the Python files of ``contextkit/`` and of each
mapped folder (grimp's file walk does not follow symlinks), first on ``PYTHONPATH``.

    python tools/lint_layers.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    with tempfile.TemporaryDirectory(prefix="contextkit-layers-") as tmp:
        pkg = Path(tmp) / "contextkit"
        only_python = shutil.ignore_patterns("__pycache__", "*.c", "*.so", "*.md")
        shutil.copytree(REPO / "contextkit", pkg, ignore=only_python)
        for name, folder in mapping.items():
            if name != "contextkit":
                shutil.copytree(REPO / folder, pkg / name.removeprefix("contextkit."), ignore=only_python)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        exe = Path(sys.executable).parent / "lint-imports"
        # import-linter puts the cwd first on sys.path
        return subprocess.call([str(exe), str(REPO / "pyproject.toml")], env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
