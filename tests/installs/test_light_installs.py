"""Each light install the way a user makes it: a fresh venv, the project's own wheel with one extra, from
the package index. The proxy extra runs the proxy in front of the suite's vLLM and answers a documents
request with its order; the client extra's SDK and both adapters call that proxy. Neither imports an engine
(torch, transformers, vLLM, LMCache); what a light install lacks is asked for by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from contextkit.bench.installs import ROLES, build_wheel, import_probe, install, venv_mb
from contextkit.integrations.launchers.servers import proxy_process

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
ENGINE = {"torch", "transformers", "vllm", "lmcache"}
# the light venvs run their own install: this checkout on a PYTHONPATH would hide a missing dependency
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}


@pytest.fixture(scope="module")
def light(tmp_path_factory):
    """The wheel and a venv per light extra (module-scoped: pip runs once per extra)."""
    root = tmp_path_factory.mktemp("light")
    wheel = build_wheel(root / "dist")
    return {name: install(root, role=role, wheel=wheel) for name, role in ROLES.items()}


@pytest.fixture(scope="module")
def light_proxy(light, vllm_url, smol_dir, tmp_path_factory):
    """``contextkit proxy`` run by the proxy venv's interpreter, in front of the suite's vLLM."""
    log = tmp_path_factory.mktemp("light-proxy") / "proxy.log"
    with proxy_process(upstream=vllm_url, model=str(smol_dir), cache_dir=tmp_path_factory.mktemp("cache"),
                       log_file=log, args=["--host", "127.0.0.1", "--allow-client-tenant"],
                       python=light["proxy"].python) as p:
        yield p.url


def test_the_light_installs_import_no_engine_and_fit_their_budget(light):
    for name, inst in light.items():
        _, heavy = import_probe(inst, reps=1)
        assert not heavy, f"contextkit[{name}] imported {heavy}"
        assert venv_mb(inst.venv) < inst.role.budget_mb, name
        show = subprocess.run([str(inst.python), "-m", "pip", "show", "torch"], capture_output=True, text=True,
                              env=ENV)
        assert show.returncode != 0, f"contextkit[{name}] installed torch"


def test_commands_a_light_install_lacks_name_the_extra_that_adds_them(light):
    for cmd in (["serve"], ["generate", "hi"], ["models", "prepare"]):
        proc = subprocess.run([str(light["proxy"].bin / "contextkit"), *cmd], capture_output=True, text=True,
                              timeout=120, env=ENV)
        assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
        assert "contextkit[local]" in proc.stderr and "Traceback" not in proc.stderr, cmd


def test_the_light_proxy_orders_documents_for_vllm(light_proxy, repo):
    ex = json.loads((repo / "examples" / "question.json").read_text())
    docs = [{"id": f"d{i}", "text": d["text"]} for i, d in enumerate(ex["documents"])]
    model = httpx.get(light_proxy + "/v1/models", timeout=30).json()["data"][0]["id"]

    def ask(documents):
        body = {"model": model, "messages": [{"role": "user", "content": ex["question"]}], "documents": documents,
                "max_tokens": 4, "temperature": 0}
        r = httpx.post(light_proxy + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    first, again = ask(docs), ask(docs[::-1])
    assert sorted(first["contextkit"]["order"]) == [d["id"] for d in docs]
    assert again["contextkit"]["order"] == first["contextkit"]["order"] and again["contextkit"]["reordered"]
    assert again["contextkit"]["cached_tokens"] > 0  # the order vLLM already holds: its prefix cache hit
    assert first["choices"][0]["message"]["content"]


def test_the_client_sdk_and_both_adapters_call_the_proxy(light, light_proxy, repo):
    client = light["client"]
    # the frameworks are the application's own dependencies, installed beside the client extra
    subprocess.run([str(client.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                    "langchain-core>=0.3", "llama-index-core>=0.14.3"], check=True, capture_output=True,
                   timeout=900, env=ENV)
    proc = subprocess.run([str(client.python), str(HERE / "client_smoke.py"), light_proxy,
                           str(repo / "examples" / "question.json")], capture_output=True, text=True, timeout=600,
                          cwd="/", env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    for who in ("sdk", "langchain", "llamaindex"):
        got = seen[who]
        assert got["path"] == "prompt" and got["second"] == got["first"] and got["reordered"], (who, got)
        assert got["cached_tokens"] > 0, (who, got)
    assert "contextkit[local]" in seen["connect_local"]
    assert seen["fork"] == {"errors": [None], "kept": [None]}  # workers answered; the proxy keeps no KV yet
    assert not ENGINE & set(seen["engine_after_sdk"]) and not ENGINE & set(seen["engine_after_adapters"])


def test_the_dev_interpreter_is_not_the_one_under_test(light):
    """The venvs run their own install, not this checkout on a path (a leaked PYTHONPATH would hide a
    missing dependency)."""
    out = subprocess.run([str(light["proxy"].python), "-c", "import contextkit; print(contextkit.__file__)"],
                         capture_output=True, text=True, check=True, cwd="/", env=ENV).stdout
    assert "site-packages" in out and str(light["proxy"].venv) in out
    assert sys.prefix not in out
