"""Fixtures of the integration tests: a recording hop in front of vLLM (root conftest: a keyed serve, an open proxy)."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A real HTTP hop in front of vLLM that records what it receives (but the proxy's health probes) and
    the bytes vLLM answers, and hands them on unchanged (event streams chunk by chunk)."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    seen: list = []

    def _forward(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
        with httpx.stream(self.command, type(self).upstream + self.path, content=body, headers=headers,
                          timeout=120) as r:
            raw = b"".join(r.iter_raw())
        if (self.command, self.path) != ("GET", "/health"):
            # the proxy's own health probes (every ``health_interval_s``) carry nothing of a client's and land at
            # any moment: recorded, one arriving after a test's request became its ``seen[-1]`` (an empty body)
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
