"""The one configuration object, passed down explicitly. Validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from contextkit.errors import ConfigError

DEFAULT_CACHE_DIR = Path("~/.cache/contextkit")


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
    """

    model: str = "smollm2-135m-instruct"
    cache_dir: Path = field(default=DEFAULT_CACHE_DIR)
    dtype: str = "float32"
    threads: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must be a packaged model name or a model directory, got ''")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 or None, got {self.threads}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
