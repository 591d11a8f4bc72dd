"""Local service processes the KV store talks to: Redis and LMCache's ``lmcache_server``.

Each runs on loopback in its own process group, is waited for by TCP connect, and is stopped by PID
(SIGTERM to the group, SIGKILL after a grace period). Used by the test harness (``tools/with_services.py``),
by fault tests that kill a server mid-run, and by ``contextkit bench store`` when no URL is given.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from contextkit.errors import ConfigError
from contextkit.integrations.vllm_server import UpstreamError, free_port


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


class Service:
    """A server process listening on ``host:port``; ``url`` is how clients name it."""

    def __init__(self, name: str, argv: list[str], host: str, port: int, scheme: str, log_file: Path | None = None):
        self.name, self.argv, self.host, self.port = name, argv, host, port
        self.url = f"{scheme}://{host}:{port}"
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> Service:
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UpstreamError(f"{self.name} exited with code {self.proc.returncode} at start ({' '.join(self.argv)})")
            if port_open(self.host, self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise UpstreamError(f"{self.name} did not listen on {self.host}:{self.port} within {timeout_s:.0f} s")

    def stop(self, grace_s: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            self.kill_hard(proc)

    def kill(self) -> None:
        """SIGKILL now: what a crash looks like to clients (fault tests)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self.kill_hard(proc)

    @staticmethod
    def kill_hard(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


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
