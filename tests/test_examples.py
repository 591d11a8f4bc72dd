"""Every script in examples/ runs as a user would copy it, and says something sensible."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_every_example_runs(repo, config, smol_dir):
    scripts = sorted((repo / "examples").glob("*.py"))
    assert scripts
    env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(config.cache_dir))
    for script in scripts:
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=env,
                              cwd=repo)
        assert proc.returncode == 0, (script.name, proc.stderr)
        answer, _, stats = proc.stdout.rpartition("\n[")
        assert answer.strip() and "prompt tokens" in stats, (script.name, proc.stdout)
