"""The upstream pool: leases, health out and back in (placement: ``test_routing.py``)."""

from __future__ import annotations

import asyncio
import http.server
import threading

import aiohttp
import pytest

from contextkit.core.errors import ConfigError
from contextkit.core.types import Doc
from contextkit.integrations.proxy.upstreams import UpstreamPool


def _docs(ids):
    return [Doc(id=i, tokens=64) for i in ids]


def test_an_upstream_pool_needs_http_urls():
    with pytest.raises(ConfigError):
        UpstreamPool([], 32)
    with pytest.raises(ConfigError):
        UpstreamPool(["localhost:8000"], 32)


@pytest.mark.parametrize("url", ["http://admin:hunter2-secret@vllm:8000", "https://token-secret@vllm:8000",
                                 "http://vllm:8000/?api_key=hunter2-secret", "http://vllm:8000/#hunter2-secret"])
def test_an_upstream_url_with_a_secret_in_it_is_refused_without_echoing_it(url):
    # the URL is logged and labels /metrics: a credential in it would be published there
    with pytest.raises(ConfigError) as err:
        UpstreamPool(["http://ok:8000", url], 32)
    msg = str(err.value)
    assert "upstream #2" in msg and "--upstream-api-key" in msg
    assert "secret" not in msg and "hunter2" not in msg


def test_a_base_url_with_a_path_and_port_is_kept():
    pool = UpstreamPool(["http://vllm:8000/", "https://gw.example/v/a/"], 32)
    assert [u.url for u in pool.upstreams] == ["http://vllm:8000", "https://gw.example/v/a"]


def test_a_lease_cannot_leak():
    pool = UpstreamPool(["http://a:1"], block_size=32)
    (u,) = pool.upstreams
    with pytest.raises(RuntimeError):
        with pool.lease(u):
            assert u.inflight == 1 and u.requests == 1
            raise RuntimeError("the request failed half-way")
    assert u.inflight == 0 and u.requests == 1


class _Health(http.server.BaseHTTPRequestHandler):
    ok = True
    answer = threading.Event()  # cleared: /health answers only once the test sets it (a busy server)

    def do_GET(self):
        type(self).answer.wait()
        self.send_response(200 if type(self).ok else 500)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_health_checks_take_an_upstream_out_and_put_it_back():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    pool = UpstreamPool([f"http://127.0.0.1:{srv.server_port}", "http://127.0.0.1:9"], block_size=32)
    _Health.answer.set()

    async def check():
        async with aiohttp.ClientSession() as c:
            await pool.check(c)

    try:
        asyncio.run(check())
        assert [u.healthy for u in pool.upstreams] == [True, False]  # nothing listens on port 9
        _Health.ok = False
        asyncio.run(check())
        assert not pool.upstreams[0].healthy
        _Health.ok = True
        asyncio.run(check())
        assert pool.upstreams[0].healthy
    finally:
        srv.shutdown()


def test_a_slow_health_answer_takes_an_upstream_out_only_when_it_repeats():
    """A busy CPU server answers /health late but still serves: one or two timeouts leave it in rotation
    (the proxy answered 503 to everything until the next check when one timeout took it out), three in a
    row take it out, an answer puts it back."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    pool = UpstreamPool([f"http://127.0.0.1:{srv.server_port}"], block_size=32)
    (u,) = pool.upstreams

    async def check():
        async with aiohttp.ClientSession() as c:
            await pool.check(c, timeout_s=0.2)

    _Health.ok = True
    _Health.answer.clear()
    try:
        for _ in range(2):
            asyncio.run(check())
            assert u.healthy and pool.least_loaded() is u
        asyncio.run(check())
        assert not u.healthy and pool.least_loaded() is None
        _Health.answer.set()
        asyncio.run(check())
        assert u.healthy and u.slow_checks == 0
    finally:
        _Health.answer.set()
        srv.shutdown()
