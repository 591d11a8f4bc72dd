"""The machine as the server benches see it: which cores an engine and a server get, and what a server
process uses (resident memory, CPU time), read with ``psutil`` by PID."""

from __future__ import annotations

import os

import psutil

from contextkit.core.errors import ConfigError


def rss_kb(pid: int) -> int:
    """Resident memory of the process, in KiB."""
    return psutil.Process(pid).memory_info().rss // 1024


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (vLLM's API server, engine core and worker), MiB."""
    proc = psutil.Process(pid)
    total = 0
    for p in (proc, *proc.children(recursive=True)):
        try:
            total += p.memory_info().rss
        except psutil.Error:  # a child that exited meanwhile
            continue
    return round(total / 2**20, 1)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def split_cpus(pin: bool, proxy_cpus: str, starting_engine: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(engine cores, proxy + load generator cores); () = not pinned. When the bench starts vLLM on a
    machine with >= 2 cores, the engine gets all but the last and the proxy and the load generator the
    last, as a proxy in front of a GPU server has a core of its own (on a CPU engine sharing all cores,
    the TTFT difference measures a fight for CPU, not the proxy). ``--set pin=0`` shares all cores;
    ``--set proxy_cpus=3`` names the proxy's cores (the engine, if the bench starts it, gets the rest)."""
    have = sorted(os.sched_getaffinity(0))
    if not pin or len(have) < 2:
        return (), ()
    if proxy_cpus:
        try:
            mine = tuple(int(c) for c in proxy_cpus.split(","))
        except ValueError:
            raise ConfigError(f"--set proxy_cpus takes a comma list of core numbers, got {proxy_cpus!r}") from None
        if not set(mine) < set(have):
            raise ConfigError(f"--set proxy_cpus={proxy_cpus}: must be a proper subset of the cores {have}")
        return (tuple(c for c in have if c not in mine) if starting_engine else ()), mine
    return (tuple(have[:-1]), (have[-1],)) if starting_engine else ((), ())
