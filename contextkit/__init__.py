"""contextkit: context-reuse middleware for RAG and agent workloads.

The public API is what ``__all__`` lists; everything else may change between releases.
"""

from contextkit.config import ContextKitConfig, KVStoreConfig
from contextkit.engine import Engine, Generation, KVCache, SamplingParams
from contextkit.errors import (
    ConfigError,
    ContextKitError,
    CorruptModelError,
    EmptyInputError,
    InputError,
    KVCacheError,
    ModelError,
    ModelNotFoundError,
    PromptTooLongError,
    UnsupportedModelError,
)
from contextkit.kit import ContextKit
from contextkit.ordering.weaver import Weaver
from contextkit.plan import PlanItem, RequestPlan, ReuseOptions, ReuseReport
from contextkit.spans.assemble import Assembly, SpanCache
from contextkit.types import Evidence, Span

__version__ = "0.1.0"

__all__ = [
    "Assembly",
    "PlanItem",
    "RequestPlan",
    "ReuseOptions",
    "ReuseReport",
    "Span",
    "SpanCache",
    "ConfigError",
    "ContextKit",
    "ContextKitConfig",
    "ContextKitError",
    "CorruptModelError",
    "EmptyInputError",
    "Engine",
    "Evidence",
    "Generation",
    "InputError",
    "KVCache",
    "KVCacheError",
    "ModelError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "SamplingParams",
    "UnsupportedModelError",
    "KVStoreConfig",
    "Weaver",
    "__version__",
]
