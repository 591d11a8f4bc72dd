"""Which optional packages this install lacks: the one check behind every "install the extra" error (the
CLI's engine commands, ``connect()`` without a URL, preparing a packaged model)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

LOCAL_EXTRA = "pip install 'contextkit[local]'"
# what the built-in engine needs that the light installs (client, proxy) leave out
ENGINE_PACKAGES = ("torch", "transformers", "safetensors")


def missing(packages: Sequence[str] = ENGINE_PACKAGES) -> list[str]:
    """The ones of ``packages`` that cannot be imported here (found without importing them)."""
    return [p for p in packages if importlib.util.find_spec(p) is None]
