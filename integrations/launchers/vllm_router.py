"""Start and stop vllm-router (PyPI ``vllm-router``: the Rust router vLLM fleets run) on loopback.

Used by ``bench fleet`` and the fleet tests, which put the proxy in front of it (docs/deployment.md says
when to choose which). The router runs in its own process group and is stopped by PID.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.process import ManagedProcess, free_port, health

POLICIES = ("round_robin", "cache_aware", "kv_aware", "power_of_two", "consistent_hash", "random")


def router_binary() -> str | None:
    """vllm-router's executable: beside this interpreter (a venv's), else on PATH; None: not installed."""
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.is_file() else shutil.which("vllm-router")


def router_process(workers: Sequence[str], *, policy: str = "cache_aware", log_file: Path | None = None,
                   api_key: str | None = None, startup_timeout_s: float = 120.0) -> tuple[ManagedProcess, str]:
    """vllm-router over ``workers`` with ``policy``, started and answering ``/health``: (process, URL).
    ``api_key``: the key the workers were started with (``vllm --api-key``): the router sends it to them and
    asks it of its own clients (401 without it), so a proxy in front sends it as its ``upstream_api_key``."""
    if policy not in POLICIES:
        raise ConfigError(f"vllm-router policy {policy!r} is not one of {', '.join(POLICIES)}")
    binary = router_binary()
    if binary is None:
        raise ConfigError("vllm-router is not installed: pip install vllm-router (contextkit[fleet])")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *workers]
    if api_key:
        argv += ["--api-key", api_key]  # not a secret on a command line: a test's, or a fleet's internal key
    proc = ManagedProcess("vllm-router", argv, partial(health, url), log_file=log_file,
                          startup_timeout_s=startup_timeout_s)
    proc.start()
    return proc, url
