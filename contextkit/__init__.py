"""contextkit: context-reuse middleware for RAG and agent workloads.

The public API is what ``__all__`` lists; everything else may change between releases.
"""

from contextkit.core.config import ContextKitConfig, KVStoreConfig
from contextkit.core.errors import (
    AuthenticationError,
    ConfigError,
    ContextKitError,
    CorruptEntryError,
    CorruptModelError,
    EmptyInputError,
    InputError,
    KVCacheError,
    ModelError,
    ModelNotFoundError,
    OverloadedError,
    PermissionDeniedError,
    PromptTooLongError,
    RateLimitError,
    UnsupportedModelError,
    UpstreamError,
)
from contextkit.sdk.shapes import Answer, ReuseSummary
from contextkit.core.generation import Generation, SamplingParams
from contextkit.core.kvcache import KVCache
from contextkit.core.plan import PlanItem, RequestPlan, ReuseOptions, ReuseReport
from contextkit.core.planner import ChatRequest, Planner
from contextkit.sdk.session import Client, Session
from contextkit.core.tenant import Tenant
from contextkit.core.types import Evidence, Message, Skill, Span
from contextkit.engine import Engine
from contextkit.kit import ContextKit
from contextkit.ordering.weaver import Weaver
from contextkit.sdk import connect
from contextkit.spans.assemble import Assembly, SpanCache
from contextkit.synthesis.skills import ErrataRule, SkillError, SkillLibrary

__version__ = "0.1.0"

__all__ = [
    "Answer",
    "AuthenticationError",
    "OverloadedError",
    "PermissionDeniedError",
    "RateLimitError",
    "Client",
    "ReuseSummary",
    "Session",
    "connect",
    "Assembly",
    "ChatRequest",
    "CorruptEntryError",
    "Message",
    "Planner",
    "Tenant",
    "UpstreamError",
    "PlanItem",
    "RequestPlan",
    "ReuseOptions",
    "ReuseReport",
    "Skill",
    "SkillError",
    "SkillLibrary",
    "ErrataRule",
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
