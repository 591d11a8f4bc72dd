"""Local service processes the KV store talks to: Redis and LMCache's ``lmcache_server``.

Each runs on loopback in its own process group (``integrations.process.ManagedProcess``), is waited for
by TCP connect, and is stopped by PID. Used by the test harness (``tools/with_services.py``), by fault
tests that kill a server mid-run, and by ``contextkit bench store`` when no URL is given.
"""

from __future__ import annotations

import shutil
import sys
from functools import partial
from pathlib import Path

from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.process import ManagedProcess, free_port, port_open


class Service(ManagedProcess):
    """A server process listening on ``host:port``; ``url`` is how clients name it."""

    def __init__(self, name: str, argv: list[str], host: str, port: int, scheme: str, log_file: Path | None = None):
        super().__init__(name, argv, partial(port_open, host, port), log_file=log_file)
        self.host, self.port = host, port
        self.url = f"{scheme}://{host}:{port}"

    def __enter__(self) -> Service:
        self.start()
        return self


def redis_server(port: int = 0, host: str = "127.0.0.1", log_file: Path | None = None) -> Service:
    """Debian's ``redis-server``, no persistence (``--save ''``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ConfigError("redis-server is not installed; `apt-get install redis-server` (make test does it)")
    port = port or free_port(host)
    argv = [exe, "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no"]
    return Service("redis-server", argv, host, port, "redis", log_file)


def lmcache_server(port: int = 0, host: str = "127.0.0.1", log_file: Path | None = None) -> Service:
    """LMCache's own KV server (``lmcache_server HOST PORT cpu``), from this interpreter's environment."""
    exe = Path(sys.executable).parent / "lmcache_server"
    if not exe.is_file():
        found = shutil.which("lmcache_server")
        if found is None:
            raise ConfigError("lmcache_server not found; pip install 'contextkit[lmcache]'")
        exe = Path(found)
    port = port or free_port(host)
    return Service("lmcache_server", [str(exe), host, str(port), "cpu"], host, port, "lm", log_file)
