"""The public surface is small and pinned: adding or removing a name is a deliberate change here."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import contextkit

PUBLIC = [
    "Assembly", "PlanItem", "RequestPlan", "ReuseOptions", "ReuseReport", "Span", "SpanCache",
    "ConfigError", "ContextKit", "ContextKitConfig", "ContextKitError", "CorruptModelError", "EmptyInputError",
    "Engine", "Evidence", "Generation", "InputError", "KVCache", "KVCacheError", "ModelError",
    "ModelNotFoundError", "PromptTooLongError", "SamplingParams", "UnsupportedModelError", "__version__",
    "KVStoreConfig", "Weaver", "ChatRequest", "CorruptEntryError", "Message", "Planner", "Tenant", "UpstreamError",
    "Skill", "SkillError", "SkillLibrary", "ErrataRule",
    "Answer", "Client", "ReuseSummary", "Session", "connect",  # the SDK
    "AuthenticationError", "OverloadedError", "PermissionDeniedError", "RateLimitError",  # what HTTP calls raise
]


def test_all_is_pinned():
    assert sorted(contextkit.__all__) == sorted(PUBLIC)
    for name in contextkit.__all__:
        assert hasattr(contextkit, name), name


LIGHT = {  # what a light install imports first, by role
    "package": ["contextkit"],
    "proxy": ["contextkit.integrations.proxy.app", "contextkit.integrations.proxy.openapi"],
    "client": ["contextkit.sdk.http", "contextkit.sdk.session"],
    "adapters": ["contextkit.integrations.frameworks.langchain", "contextkit.integrations.frameworks.llamaindex"],
}
ENGINE = ["torch", "transformers", "vllm", "lmcache"]


@pytest.mark.parametrize("role", sorted(LIGHT))
def test_light_entry_points_import_no_engine(role):
    """In a fresh interpreter of the dev environment (where every engine IS installed, so only an import
    would load it): the package, the proxy, the HTTP client and the adapters load none of them."""
    code = (f"import importlib, json, sys\nfor m in {LIGHT[role]!r}: importlib.import_module(m)\n"
            f"print(json.dumps([m for m in {ENGINE!r} if m in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd=str(Path(__file__).parent))
    assert json.loads(out.stdout.splitlines()[-1]) == [], role


def test_public_names_resolve_on_first_use():
    code = ("import sys, contextkit\nassert 'contextkit.kit' not in sys.modules\n"
            "k = contextkit.ContextKit\nassert 'contextkit.kit' in sys.modules and k.__name__ == 'ContextKit'\n"
            "assert contextkit.ContextKit is k and 'ContextKit' in dir(contextkit)\n"
            "try:\n    contextkit.NoSuchName\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "has no attribute 'NoSuchName'" in out.stdout


def test_py_typed_ships():
    assert (Path(contextkit.__file__).parent / "py.typed").is_file()


def test_every_folder_imports_as_a_subpackage():
    for sub in ("ordering", "spans", "kvstore", "kernels", "synthesis", "integrations", "engine", "bench"):
        mod = importlib.import_module(f"contextkit.{sub}")
        assert mod.__doc__, sub


def test_errors_form_one_tree():
    for name in PUBLIC:
        obj = getattr(contextkit, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, contextkit.ContextKitError)


def test_facade_answers_over_evidence(smol_dir):
    kit = contextkit.ContextKit(contextkit.ContextKitConfig(model=str(smol_dir)))
    g = kit.generate(
        "What colour is the door?",
        [contextkit.Evidence("The door of the house is painted bright red.", title="House")],
        params=contextkit.SamplingParams(max_new_tokens=16),
    )
    assert "red" in g.text.lower()
    assert g.prompt_tokens > 10 and g.prefill_ms > 0 and g.reuse is None
    docs = [contextkit.Evidence("The door of the house is painted bright red.", title="House"),
            contextkit.Evidence("The garden behind the house has apple trees.", title="Garden")]
    first = kit.generate("What colour is the door?", docs, params=contextkit.SamplingParams(max_new_tokens=16),
                         reuse=contextkit.ReuseOptions())
    again = kit.generate("What grows in the garden?", docs[::-1], params=contextkit.SamplingParams(max_new_tokens=16),
                         reuse=contextkit.ReuseOptions())
    assert first.reuse is not None and first.reuse.misses == 3  # system prefix + two documents compiled
    assert again.reuse.hits == 3 and again.reuse.misses == 0  # reused, in another order
    assert again.reuse.rerotated_tokens > 0 and again.text
