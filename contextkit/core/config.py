"""The one configuration object, passed down explicitly. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from contextkit.core.errors import ConfigError

DEFAULT_CACHE_DIR = Path("~/.cache/contextkit")


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
        if self.remote_url and not self.remote_url.startswith(("lm://", "redis://")):
            raise ConfigError(f"kvstore remote_url must start with lm:// or redis://, got {self.remote_url!r}")
        if self.disk_dir is not None:
            object.__setattr__(self, "disk_dir", Path(self.disk_dir).expanduser())


@dataclass(frozen=True, slots=True)
class ContextKitConfig:
    """Settings shared by every contextkit component.

    Attributes:
        model: a packaged model name (``contextkit models list``) or a prepared model directory.
        cache_dir: where prepared models (and later, KV) are kept.
        dtype: engine dtype. float32 is the default on CPU: it matches transformers to 1e-4 and runs
            on every x86 CPU; bfloat16 prefills ~2x faster on CPUs with AVX512-BF16/AMX (see
            ``contextkit bench engine``) at a measured fidelity cost.
        threads: torch intra-op threads; None leaves torch's default.
        kvstore: where span KV lives (memory tier; optional LMCache disk and remote tiers).
        secret: the deployment secret (>= 32 characters) that keys the MAC of KV leaving the process (and
            a server's cache salts); None: the one in ``<cache_dir>/secret``, made once. Processes that
            share a disk or remote tier share it.
    """

    model: str = "smollm2-135m-instruct"
    cache_dir: Path = field(default=DEFAULT_CACHE_DIR)
    dtype: str = "float32"
    threads: int | None = None
    kvstore: KVStoreConfig = field(default_factory=KVStoreConfig)
    secret: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must be a packaged model name or a model directory, got ''")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or None, got {self.threads}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())

    def load_secret(self) -> bytes:
        """The deployment secret (``contextkit.core.tenancy.load_secret``)."""
        from contextkit.core.tenancy import deployment_secret

        return deployment_secret(self.cache_dir, self.secret)
