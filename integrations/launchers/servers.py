"""``contextkit proxy`` and ``contextkit serve`` as child processes, as they are deployed: the one way the
benches (and tools) start them.

Each server gets a free loopback port, this interpreter, ``CONTEXTKIT_CACHE_DIR`` pointing at the caller's
cache, optionally a set of cores (``taskset``), and runs in its own process group through
``ManagedProcess``: ``start()`` waits for ``GET /health``, ``stop()`` ends the whole group by PID.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Self

from contextkit.integrations.launchers.process import ManagedProcess, free_port, health


class CLIServer(ManagedProcess):
    """A ``contextkit`` server subcommand in its own process group; ``url`` is where it answers."""

    def __init__(self, name: str, cli_args: Sequence[str], *, cache_dir: Path, log_file: Path | None,
                 cpus: Sequence[int] = (), startup_timeout_s: float = 120.0, python: str | Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
        argv = [*pin, str(python or sys.executable), "-m", "contextkit.cli", *cli_args, "--port", str(self.port)]
        env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(cache_dir))
        if python is not None:  # another environment: this one's source tree must not shadow its install
            env.pop("PYTHONPATH", None)
            env["PYTHONSAFEPATH"] = "1"  # `python -m` would put the cwd (a checkout) first on sys.path
        super().__init__(name, argv, partial(health, self.url), env=env, log_file=log_file,
                         startup_timeout_s=startup_timeout_s)

    @property
    def pid(self) -> int:
        """The server's PID (``taskset`` execs it, so pinned or not it is the child's)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} is not running")
        return self.proc.pid

    def __enter__(self) -> Self:
        self.start()
        return self


def proxy_process(*, upstream: str, model: str, cache_dir: Path, log_file: Path | None, args: Sequence[str] = (),
                  cpus: Sequence[int] = (), startup_timeout_s: float = 120.0,
                  python: str | Path | None = None) -> CLIServer:
    """``contextkit proxy --upstream UPSTREAM --model MODEL *args`` (not started yet), on ``python`` (another
    environment's interpreter, e.g. a light install's) or this one."""
    return CLIServer("contextkit proxy", ["proxy", "--upstream", upstream, "--model", model, *args],
                     cache_dir=cache_dir, log_file=log_file, cpus=cpus, startup_timeout_s=startup_timeout_s,
                     python=python)


def serve_process(*, model: str, cache_dir: Path, log_file: Path | None, args: Sequence[str] = (),
                  cpus: Sequence[int] = (), startup_timeout_s: float = 300.0) -> CLIServer:
    """``contextkit serve --model MODEL *args`` (not started yet)."""
    return CLIServer("contextkit serve", ["serve", "--model", model, *args], cache_dir=cache_dir,
                     log_file=log_file, cpus=cpus, startup_timeout_s=startup_timeout_s)
