"""The benches' one HTTP call to a completion server (``bench.harness.post_completion``), against a real
HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from contextkit.bench.harness import post_completion
from contextkit.core.errors import UpstreamError


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        ok = self.path == "/v1/completions" and body.get("prompt") != "fail"
        out = json.dumps({"echo": body} if ok else {"error": "overloaded"}).encode()
        self.send_response(200 if ok else 503)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    thread.join(5)


def test_a_completion_comes_back_as_json_with_its_time(server):
    ms, obj = post_completion(server, {"prompt": [1, 2], "max_tokens": 1})
    assert obj == {"echo": {"prompt": [1, 2], "max_tokens": 1}} and ms >= 0


def test_an_error_status_names_the_server_and_the_answer(server):
    with pytest.raises(UpstreamError, match=r"answered 503: .*overloaded"):
        post_completion(server, {"prompt": "fail"})
