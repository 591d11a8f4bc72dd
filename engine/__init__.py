"""The built-in engine: model forward with an explicit, caller-owned KV cache.

``Engine`` implements ``contextkit.core.engine.KVEngine``, the seam the span cache talks to.
"""

from contextkit.engine.generate import Stream
from contextkit.engine.model import Engine

__all__ = ["Engine", "Stream"]
