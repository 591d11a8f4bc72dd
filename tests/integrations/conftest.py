"""Fixtures of the integration tests: an ASGI app served in a thread, and small real trace requests."""

from __future__ import annotations

import http.server
import json
import random
import threading
import time

import httpx
import pytest

from contextkit.bench.workload import TraceDoc, TraceRequest
from contextkit.integrations.launchers.process import free_port


class AppThread:
    """An ASGI app under uvicorn in a daemon thread, on a free loopback port (``with`` starts and stops it)."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A real HTTP hop in front of vLLM that records what it receives and the bytes vLLM answers, and
    hands them on unchanged (event streams chunk by chunk)."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    seen: list = []

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        with httpx.stream(self.command, type(self).upstream + self.path, content=body, headers=headers, timeout=120) as r:
            raw = b"".join(r.iter_raw())
        type(self).seen.append({"path": self.path, "body": body, "status": r.status_code, "answer": raw,
                                "headers": dict(self.headers.items())})
        self.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                self.send_header(k, v)
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = _forward

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def recorder(vllm_url):
    """(the recording handler class, the hop's URL): a real HTTP hop in front of the test vLLM; what it
    received is in ``.seen`` (one list per module)."""
    handler = type("Recorder", (_Recorder,), {"upstream": vllm_url, "seen": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


@pytest.fixture(scope="session")
def app_thread():
    """``app_thread(asgi_app)``: a context manager serving it on loopback (``.url``, ``.app``)."""
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
