"""contextkit: context-reuse middleware for RAG and agent workloads.

The public API is what ``__all__`` lists; everything else may change between releases.

Every public name resolves on first use (PEP 562): ``import contextkit`` loads nothing heavy, so the
proxy, the HTTP SDK client and the framework adapters run without torch, transformers, vLLM or LMCache
installed (the ``proxy`` and ``client`` extras); ``contextkit.ContextKit`` or ``contextkit.Engine``
loads the built-in engine when first touched (the ``local`` extra).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_HOMES: dict[str, str] = {
    **dict.fromkeys(["ContextKitConfig", "KVStoreConfig"], "contextkit.core.config"),
    **dict.fromkeys([
        "AuthenticationError", "ConfigError", "ContextKitError", "CorruptEntryError", "CorruptModelError",
        "EmptyInputError", "InputError", "KVCacheError", "ModelError", "ModelNotFoundError",
        "OverloadedError", "PermissionDeniedError", "PromptTooLongError", "RateLimitError",
        "UnsupportedModelError", "UpstreamError",
    ], "contextkit.core.errors"),
    **dict.fromkeys(["Answer", "ReuseSummary"], "contextkit.sdk.shapes"),
    **dict.fromkeys(["Generation", "SamplingParams"], "contextkit.core.generation"),
    "KVCache": "contextkit.core.kvcache",
    **dict.fromkeys(["PlanItem", "RequestPlan", "ReuseReport"], "contextkit.core.plan"),
    "ReuseOptions": "contextkit.core.policy",
    **dict.fromkeys(["ChatRequest", "Planner"], "contextkit.core.planner"),
    **dict.fromkeys(["Client", "Session"], "contextkit.sdk.session"),
    "Tenant": "contextkit.core.tenant",
    **dict.fromkeys(["Evidence", "Message", "Skill", "Span"], "contextkit.core.types"),
    "Engine": "contextkit.engine",
    "ContextKit": "contextkit.kit",
    "Weaver": "contextkit.ordering.weaver",
    "connect": "contextkit.sdk",
    **dict.fromkeys(["Assembly", "SpanCache"], "contextkit.spans.assemble"),
    **dict.fromkeys(["ErrataRule", "SkillError", "SkillLibrary"], "contextkit.synthesis.skills"),
}

__all__ = [
    "Answer",
    "Assembly",
    "AuthenticationError",
    "ChatRequest",
    "Client",
    "ConfigError",
    "ContextKit",
    "ContextKitConfig",
    "ContextKitError",
    "CorruptEntryError",
    "CorruptModelError",
    "EmptyInputError",
    "Engine",
    "ErrataRule",
    "Evidence",
    "Generation",
    "InputError",
    "KVCache",
    "KVCacheError",
    "KVStoreConfig",
    "Message",
    "ModelError",
    "ModelNotFoundError",
    "OverloadedError",
    "PermissionDeniedError",
    "PlanItem",
    "Planner",
    "PromptTooLongError",
    "RateLimitError",
    "RequestPlan",
    "ReuseOptions",
    "ReuseReport",
    "ReuseSummary",
    "SamplingParams",
    "Session",
    "Skill",
    "SkillError",
    "SkillLibrary",
    "Span",
    "SpanCache",
    "Tenant",
    "UnsupportedModelError",
    "UpstreamError",
    "Weaver",
    "__version__",
    "connect",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'contextkit' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # resolved once; later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


if TYPE_CHECKING:  # what type checkers and IDEs see: the eager imports, never run
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
    from contextkit.core.generation import Generation, SamplingParams
    from contextkit.core.kvcache import KVCache
    from contextkit.core.plan import PlanItem, RequestPlan, ReuseReport
    from contextkit.core.planner import ChatRequest, Planner
    from contextkit.core.policy import ReuseOptions
    from contextkit.core.tenant import Tenant
    from contextkit.core.types import Evidence, Message, Skill, Span
    from contextkit.engine import Engine
    from contextkit.kit import ContextKit
    from contextkit.ordering.weaver import Weaver
    from contextkit.sdk import connect
    from contextkit.sdk.session import Client, Session
    from contextkit.sdk.shapes import Answer, ReuseSummary
    from contextkit.spans.assemble import Assembly, SpanCache
    from contextkit.synthesis.skills import ErrataRule, SkillError, SkillLibrary
