"""The built-in engine: model forward with an explicit, caller-owned KV cache."""

from contextkit.engine.generate import Generation, SamplingParams, generate
from contextkit.engine.kvcache import KVCache
from contextkit.engine.model import Engine, ModelFingerprint
from contextkit.engine.spec import ModelSpec

__all__ = ["Engine", "Generation", "KVCache", "ModelFingerprint", "ModelSpec", "SamplingParams", "generate"]
