"""The per-tenant request rate both servers check before reading a body: token buckets on a clock the
test controls, and the 429 each server answers past it."""

from __future__ import annotations

import socket

import pytest

from contextkit.core.errors import ConfigError, RateLimitError, http_status
from contextkit.core.tenancy import Tenancy, Tenant
from contextkit.integrations.edge.answers import error_headers
from contextkit.integrations.edge.ratelimit import RateLimit, RateLimiter
from contextkit.integrations.proxy import ProxySettings, create_app

KEYS = {"key-acme-0001": "acme", "key-globex-01": "globex"}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate():
    clock = Clock()
    limiter = RateLimiter(RateLimit(2.0, 3), clock)
    acme = Tenant("acme")
    for _ in range(3):
        limiter.check(acme)  # a quiet tenant may send its burst at once
    with pytest.raises(RateLimitError) as err:
        limiter.check(acme)
    assert http_status(err.value) == 429 and "2 requests/s" in str(err.value)
    assert err.value.retry_after_s == pytest.approx(0.5)  # one token at 2/s
    assert error_headers(err.value) == {"retry-after": "1"}
    limiter.check(Tenant("globex"))  # buckets are per tenant
    clock.now += 0.5
    limiter.check(acme)  # refilled one
    with pytest.raises(RateLimitError):
        limiter.check(acme)
    clock.now += 60
    for _ in range(3):  # refills up to the burst, no more
        limiter.check(acme)
    with pytest.raises(RateLimitError):
        limiter.check(acme)
    assert limiter.refused == 3


def test_refused_requests_do_not_earn_credit():
    """A client retrying in a tight loop stays refused: a refusal takes nothing, and waiting is what refills."""
    clock = Clock()
    limiter = RateLimiter(RateLimit(1.0, 1), clock)
    limiter.check(Tenant("a"))
    for _ in range(50):
        clock.now += 0.01
        with pytest.raises(RateLimitError):
            limiter.check(Tenant("a"))
    clock.now += 0.5
    limiter.check(Tenant("a"))  # 1.0 s after the first


def test_buckets_are_bounded_and_off_means_off():
    clock = Clock()
    limiter = RateLimiter(RateLimit(1.0, 1, max_tenants=2), clock)
    for name in ("a", "b", "c"):
        limiter.check(Tenant(name))
    assert list(limiter._buckets) == ["b", "c"]  # the least recently used went first
    off = RateLimiter(RateLimit(), clock)
    for _ in range(1000):
        off.check(Tenant("a"))


def test_parse_and_bad_limits():
    assert RateLimit.parse("10/20") == RateLimit(10.0, 20)
    assert RateLimit.parse("2.5") == RateLimit(2.5, 0) and RateLimit.parse("2.5").size == 5.0
    assert not RateLimit.parse("0").on and not RateLimit.parse(None).on
    for text in ("ten", "10/x", "-1", "1/-2"):
        with pytest.raises(ConfigError, match="RATE|>= 0"):
            RateLimit.parse(text)
    with pytest.raises(ConfigError, match="burst >= 1"):
        RateLimit(0.2)  # twice the rate is under one request


def _announce_body(port: int, key: str) -> bytes:
    """Send headers that announce a 1 MB body, send none of it, and return the first answer bytes: a
    refusal must not wait for the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: 1000000\r\n\r\n")
        return sock.recv(4096)


def test_the_proxy_refuses_a_tenant_over_its_rate_before_reading_the_body(app_thread, config):
    import httpx

    # nothing listens upstream: requests within the rate get 502/503, the ones past it 429 before that
    settings = ProxySettings(upstreams=["http://127.0.0.1:9"], cache_dir=config.cache_dir, api_keys=KEYS,
                             rate_per_s=0.01, rate_burst=2, health_interval_s=3600)
    with app_thread(create_app(settings)) as p:
        acme = {"authorization": "Bearer key-acme-0001"}
        for _ in range(2):
            assert httpx.get(p.url + "/v1/models", headers=acme, timeout=30).status_code in (502, 503)
        r = httpx.get(p.url + "/v1/models", headers=acme, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 60
        assert _announce_body(p.port, "key-acme-0001").startswith(b"HTTP/1.1 429")
        assert httpx.get(p.url + "/v1/models", headers={"authorization": "Bearer key-globex-01"},
                         timeout=30).status_code in (502, 503)  # another tenant is not held back
        assert httpx.get(p.url + "/v1/models", timeout=30).status_code == 401  # no key: 401, not 429


@pytest.mark.slow
def test_serve_refuses_a_tenant_over_its_rate_before_reading_the_body(app_thread, config):
    import httpx

    from contextkit import ContextKit
    from contextkit.integrations.serve.app import ServeLimits, create_serve_app

    kit = ContextKit(config)
    try:
        limits = ServeLimits(rate=RateLimit(0.01, 2))
        with app_thread(create_serve_app(kit, "k", Tenancy(KEYS), limits)) as s:
            acme = {"authorization": "Bearer key-acme-0001"}
            body = {"model": "k", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1}
            assert httpx.get(s.url + "/v1/models", headers=acme, timeout=30).status_code == 200
            assert httpx.post(s.url + "/v1/chat/completions", json=body, headers=acme, timeout=60).status_code == 200
            r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=acme, timeout=60)
            assert r.status_code == 429 and "requests/s" in r.json()["error"]["message"]
            assert int(r.headers["retry-after"]) >= 60
            assert _announce_body(s.port, "key-acme-0001").startswith(b"HTTP/1.1 429")
            other = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60,
                               headers={"authorization": "Bearer key-globex-01"})
            assert other.status_code == 200
    finally:
        kit.close()
