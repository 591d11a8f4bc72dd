"""Every script in examples/ runs as a user would copy it, and says something sensible (one test per script,
so a failure names the script and the others still run)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))


def test_the_examples_folder_has_scripts():
    # an empty parameter list would skip test_example_runs quietly (a moved folder, say): fail instead
    assert SCRIPTS, f"no example scripts in {EXAMPLES}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script, repo, config, smol_dir):
    env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(config.cache_dir))
    proc = subprocess.run([sys.executable, str(repo / "examples" / script)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    answer, _, stats = proc.stdout.rpartition("\n[")
    assert answer.strip() and "prompt tokens" in stats, proc.stdout


def test_the_agent_example_runs_over_http_to_serve(repo, config, smol_dir):
    """``examples/agent.py --serve``: the same steps as chats to a contextkit serve it starts; the sub-agents
    keep their KV and the synthesis says how it read each one's answer."""
    env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(config.cache_dir))
    proc = subprocess.run([sys.executable, str(repo / "examples" / "agent.py"), "--serve"], capture_output=True,
                          text=True, timeout=600, env=env, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[http]"), proc.stdout
    reads = next(line for line in proc.stdout.splitlines() if line.startswith("sub-agent answers read: "))
    assert reads.count("'") >= 4, reads  # one read per sub-agent (kv, or why the text was used)
    assert "prompt tokens in the last step" in proc.stdout
