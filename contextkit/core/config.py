"""The one configuration object, passed down explicitly. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from contextkit.core.errors import ConfigError

DEFAULT_CACHE_DIR = Path("~/.cache/contextkit")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class RemoteScheme:
    """A shared (remote) KV tier: one of LMCache's remote connectors (``kvstore/lmcache_tier.py``), by URL scheme.

    Attributes:
        serves: what serves it, as messages and flag help name it.
        timeout_params: the URL query parameters that bound its socket calls; the LMCache tier sets them below
            LMCache's blocking timeout (``kvstore/lmcache_backend.py``), so a dead server is a miss, not a hang.
    """

    serves: str
    timeout_params: tuple[str, ...] = ()


# The one list of remote tiers: every setting that takes a remote URL checks against it (serve's
# KVStoreConfig, the vLLM connector's settings, CacheBlend's, the LMCache tier itself) and the LMCache tier
# builds its URL from the row. Another of LMCache's remote connectors is one row here (and its tests).
REMOTE_SCHEMES = {
    "lm": RemoteScheme("lmcache_server"),
    "redis": RemoteScheme("Redis", timeout_params=("socket_timeout", "socket_connect_timeout")),
}


def remote_url_forms() -> str:
    """The remote tier URLs ``REMOTE_SCHEMES`` allows, as a message or a flag's help says them."""
    return " or ".join(f"{name}://host:port ({scheme.serves})" for name, scheme in REMOTE_SCHEMES.items())


def check_remote_url(url: object, *, setting: str = "remote_url", alternative: str = "") -> str:
    """``url`` if it names a remote tier as ``scheme://host:port`` with a scheme of ``REMOTE_SCHEMES``; else a
    ConfigError that lists them (and ``alternative``, e.g. ", or None for no shared store")."""
    import urllib.parse

    try:
        parsed = urllib.parse.urlparse(url) if isinstance(url, str) else None
        ok = parsed is not None and parsed.scheme in REMOTE_SCHEMES and bool(parsed.hostname) and bool(parsed.port)
    except ValueError:  # a port that is not a number
        ok = False
    if not ok:
        raise ConfigError(f"{setting} must be {remote_url_forms()}{alternative}, got {url!r}")
    return url


def cpu_has_fast_bf16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16).

    Without either, bf16 is emulated and far slower than fp32 (an AVX2-only EPYC: ~100x on a matrix
    product; docs/benchmarks.md). Linux only: elsewhere False, and "auto" picks float32.
    """
    try:
        flags = cpuinfo.read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def machine_class(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """What decides the speed order of recompute settings on a CPU: its architecture, the widest matrix
    unit it has ("amx" > "avx512_bf16" > "avx512" > "avx2" > "baseline") and the cores this process may use.
    A calibration profile records it beside its speedups: the fixed part of a reuse weighs differently on
    an AVX2 box in fp32 than on an AMX one in bf16 (docs/benchmarks.md)."""
    import os
    import platform

    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        flags = set()
    unit = next((name for name, flag in (("amx", "amx_bf16"), ("avx512_bf16", "avx512_bf16"),
                                          ("avx512", "avx512f"), ("avx2", "avx2")) if flag in flags), "baseline")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"{platform.machine()}/{unit}/{cores}c"


def resolve_dtype(name: str) -> str:
    """The engine dtype for a configured name: "auto" is bfloat16 on CPUs with hardware bf16, else float32."""
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


@dataclass(frozen=True, slots=True)
class KVStoreConfig:
    """Where span KV lives (``contextkit.kvstore``).

    Attributes:
        memory_bytes: budget of the in-process memory tier (cost-aware eviction).
        disk_dir: a directory for the LMCache disk tier (survives restarts); None: no disk tier.
        disk_bytes: capacity of the disk tier.
        remote_url: ``lm://host:port`` (lmcache_server) or ``redis://host:port``, shared by processes;
            None: no remote tier.
        remote_timeout_s: deadline of one remote call; a slower or dead remote answers a miss.
        encrypt: encrypt the entries of the disk and remote tiers at rest (AES-256-GCM under a key derived
            from the secret); every entry is authenticated either way.
    """

    memory_bytes: int = 2 << 30
    disk_dir: Path | None = None
    disk_bytes: int = 8 << 30
    remote_url: str | None = None
    remote_timeout_s: float = 5.0
    encrypt: bool = False

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.disk_bytes <= 0:
            raise ConfigError("kvstore memory_bytes and disk_bytes must be positive")
        if self.remote_timeout_s <= 0:
            raise ConfigError(f"kvstore remote_timeout_s must be positive, got {self.remote_timeout_s}")
        if self.remote_url:
            check_remote_url(self.remote_url, setting="kvstore remote_url")
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", Path(self.disk_dir).expanduser())


@dataclass(frozen=True, slots=True)
class ContextKitConfig:
    """Settings shared by every contextkit component.

    Attributes:
        model: a packaged model name (``contextkit models list``) or a prepared model directory.
        cache_dir: where prepared models (and later, KV) are kept.
        dtype: engine dtype; "auto" (the default) is resolved on construction: bfloat16 on CPUs with
            AVX512-BF16 or AMX-BF16 (prefill ~3x faster than float32 there, as vLLM runs; next-token KL
            ~0.0015 vs float32, ``contextkit bench spans``), else float32, which matches transformers
            to 1e-4 in logits and runs on every x86 CPU.
        threads: torch intra-op threads; None leaves torch's default.
        kvstore: where span KV lives (memory tier; optional LMCache disk and remote tiers).
        secret: the deployment secret (>= 32 characters) that keys the MAC of KV leaving the process (and
            a server's cache salts); None: the one in ``<cache_dir>/secret``, made once. Processes that
            share a disk or remote tier share it.
        calibration: the calibration profile that resolves ``ReuseOptions(policy="budget")``
            (``contextkit calibrate``); refused with an error when made for other weights or another
            dtype. None: the one beside the model for its dtype, when there is one (one made for other
            weights is then ignored with a warning: the weights were replaced, calibrate again).
    """

    model: str = "smollm2-135m-instruct"
    cache_dir: Path = field(default=DEFAULT_CACHE_DIR)
    dtype: str = "auto"
    threads: int | None = None
    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    secret: str | None = field(default=None, repr=False)
    calibration: Path | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must be a packaged model name or a model directory, got ''")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or None, got {self.threads}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        if self.calibration is not None:
            object.__setattr__(self, "calibration", Path(self.calibration).expanduser())

    def load_secret(self) -> bytes:
        """The deployment secret (``contextkit.core.tenancy.load_secret``)."""
        from contextkit.core.tenancy import deployment_secret

        return deployment_secret(self.cache_dir, self.secret)
