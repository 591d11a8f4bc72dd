"""Cache-aware routing over several upstreams, least-loaded fallback, health out and back in."""

from __future__ import annotations

import asyncio
import http.server
import threading

import aiohttp
import pytest

from contextkit.errors import ConfigError
from contextkit.integrations.upstreams import UpstreamPool
from contextkit.ordering.weaver import Doc


def _docs(ids):
    return [Doc(i, 64) for i in ids]


def test_documents_follow_the_cache_and_the_rest_goes_to_the_least_loaded():
    pool = UpstreamPool(["http://a:1", "http://b:1"], block_size=32)
    a, b = pool.upstreams
    first, _ = pool.route(_docs("xyz"), "", reorder=True)
    assert first is a  # nothing cached anywhere: least loaded (ties to the first)
    a.requests += 1
    other, _ = pool.route(_docs("uvw"), "", reorder=True)
    assert other is b  # a new set: the less loaded one
    b.requests += 1
    again, result = pool.route(_docs("zxy"), "", reorder=True)
    assert again is a and result.reusable_tokens == 192  # the server that holds x,y,z; order restored
    assert [("zxy")[i] for i in result.order] == list("xyz")
    a.inflight = 50  # busy, but the cache still wins for a set it holds
    assert pool.route(_docs("yxz"), "", reorder=True)[0] is a
    assert pool.route(_docs("qrs"), "", reorder=True)[0] is b
    assert pool.routing["cache_aware"] == 2
    t_other, _ = pool.route(_docs("zxy"), "tenant-2", reorder=True)
    assert t_other is b  # another tenant's cache is not a's: least loaded
    a.healthy = False
    assert pool.route(_docs("xyz"), "", reorder=True)[0] is b  # out of rotation
    b.healthy = False
    assert pool.route(_docs("xyz"), "", reorder=True) == (None, None)
    with pytest.raises(ConfigError):
        UpstreamPool([], 32)
    with pytest.raises(ConfigError):
        UpstreamPool(["localhost:8000"], 32)


class _Health(http.server.BaseHTTPRequestHandler):
    ok = True

    def do_GET(self):
        self.send_response(200 if type(self).ok else 500)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_health_checks_take_an_upstream_out_and_put_it_back():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    pool = UpstreamPool([f"http://127.0.0.1:{srv.server_port}", "http://127.0.0.1:9"], block_size=32)

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
