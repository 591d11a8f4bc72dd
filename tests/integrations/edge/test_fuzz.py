"""Both servers fuzzed from their OpenAPI documents (schemathesis) over HTTP: valid and invalid bodies,
with and without a key. No case may hang, answer a status the document does not list (a 500 above all),
or answer an error that is not an OpenAI error object. Bounded: a few hundred cases each."""

from __future__ import annotations

import pytest

from contextkit import ContextKit
from contextkit.bench.fuzz import fuzz
from contextkit.core.tenancy import Tenancy
from contextkit.integrations.edge.ratelimit import RateLimit
from contextkit.integrations.proxy import ProxySettings, create_app
from contextkit.integrations.proxy.openapi import proxy_openapi_schema
from contextkit.integrations.serve.app import ServeLimits, create_serve_app

pytestmark = pytest.mark.slow
KEYS = {"key-acme-0001": "acme"}


def _assert_clean(report) -> None:
    assert report.requests > 0
    assert not report.findings, "\n".join(map(str, report.findings[:20]))
    assert len({status for _, status in report.statuses}) >= 4  # valid and invalid cases both got through


def test_fuzz_serve(config, app_thread):
    kit = ContextKit(config)
    # a short deadline bounds the valid cases that decode (504 is documented); the schema does the rest;
    # no rate limit, or most cases would be 429s that test nothing past the key check
    with app_thread(create_serve_app(kit, "k", Tenancy(KEYS), ServeLimits(deadline_s=1.0, rate=RateLimit()))) as s:
        report = fuzz(s.url, "serve", 250, "key-acme-0001", timeout_s=30)
    kit.close()
    _assert_clean(report)


def test_fuzz_proxy_in_front_of_vllm(vllm_url, config, app_thread):
    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, api_keys=KEYS, timeout_s=30)
    with app_thread(create_app(settings)) as p:
        report = fuzz(p.url, "proxy", 300, "key-acme-0001", timeout_s=45)
    _assert_clean(report)
    # every route the proxy forwards was tried (its allow-list: proxy.routes), and its own two
    assert {path for path, _ in report.statuses} == set(proxy_openapi_schema()["paths"])
