"""The one launcher for the servers contextkit starts (vLLM, Redis, lmcache_server), and the checks
that say a server is up.

A server runs in its own process group, is waited for until its readiness check passes (a TCP
connect, or ``GET /health`` answering 200), and is stopped by PID: SIGTERM to the group, SIGKILL after
a grace period, whatever happened in between.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from contextkit.core.errors import UpstreamError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    """True when something accepts a TCP connection on ``host:port``."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def health(url: str, timeout: float = 2.0) -> bool:
    """True when ``GET {url}/health`` answers 200."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_until(ready: Callable[[], bool], timeout_s: float, what: str,
               alive: Callable[[], bool] | None = None, interval_s: float = 0.1) -> None:
    """Poll ``ready`` until it passes; ``UpstreamError`` after ``timeout_s`` or once ``alive`` fails."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if alive is not None and not alive():
            raise UpstreamError(f"{what} exited while starting")
        time.sleep(interval_s)
    raise UpstreamError(f"{what} was not up within {timeout_s:.0f} s")


def wait_for_health(url: str, timeout_s: float = 300.0) -> None:
    """Wait until a server someone else started answers ``/health``."""
    try:
        wait_until(lambda: health(url), timeout_s, f"the server at {url}", interval_s=0.5)
    except UpstreamError:
        raise UpstreamError(f"no server answered {url}/health within {timeout_s:.0f} s; is it running?") from None


class ManagedProcess:
    """A server process: ``start()`` launches it and waits for ``ready``; ``stop()`` ends its group.

    Args:
        name: for messages.
        argv: the command.
        ready: the readiness check (``port_open`` or ``health`` bound to its address).
        env: the environment (None: this process's).
        log_file: stdout and stderr go here (appended); None discards them.
        startup_timeout_s: how long ``start`` waits for ``ready``.
    """

    def __init__(self, name: str, argv: Sequence[str], ready: Callable[[], bool], env: dict | None = None,
                 log_file: Path | None = None, startup_timeout_s: float = 30.0):
        self.name, self.argv, self.ready, self.env = name, list(argv), ready, env
        self.log_file, self.startup_timeout_s = log_file, startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def launch(self) -> None:
        """Start the process without waiting for it (``wait`` does that)."""
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child holds its own descriptor

    def wait(self) -> None:
        """Block until ``ready`` passes; stop the process and raise if it dies or times out."""
        try:
            wait_until(self.ready, self.startup_timeout_s, self.name, alive=lambda: self.running)
        except UpstreamError as exc:
            code = None if self.proc is None else self.proc.poll()
            self.stop()
            where = f"; its log is {self.log_file}" if self.log_file else ""
            raise UpstreamError(f"{exc} (exit code {code}; {' '.join(self.argv[:4])} ...){where}") from None

    def start(self) -> ManagedProcess:
        self.launch()
        self.wait()
        return self

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group, SIGKILL after ``grace_s``. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            _kill_group(proc)

    def kill(self) -> None:
        """SIGKILL now: what a crash looks like to clients (fault tests)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _kill_group(proc)

    def __enter__(self) -> ManagedProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
