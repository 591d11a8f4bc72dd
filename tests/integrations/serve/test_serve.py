"""``contextkit serve`` with the real ``openai`` client: the OpenAI API on the built-in engine, documents
reused as spans across requests, errors as OpenAI error objects."""

from __future__ import annotations

import contextlib
import itertools
import json
import uuid

import httpx
import openai
import pytest

from contextkit import ContextKit, Evidence, ReuseOptions, SamplingParams
from contextkit.core.tenancy import Tenancy
from contextkit.integrations.edge.ratelimit import RateLimit
from contextkit.integrations.proxy import ProxySettings, create_app
from contextkit.integrations.serve.app import ServeLimits, create_serve_app

pytestmark = pytest.mark.slow


def _fresh(name: str) -> str:
    """A tenant name no other test (nor an earlier run of this one) has used: it starts with nothing
    cached and no ordering history, whatever ran before on the module's kit."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def served(config, app_thread):
    kit = ContextKit(config)
    # open (loopback) with client-chosen tenants: the tests play several tenants without keys
    # no rate limit: the tests send bursts (test_ratelimit.py tests the limit)
    with app_thread(create_serve_app(kit, "smol-local", Tenancy(allow_client_tenant=True),
                                     ServeLimits(rate=RateLimit()))) as s:
        yield s, kit, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    kit.close()


def test_an_agent_loop_reuses_its_earlier_turns(served):
    s, kit, client = served
    agent, someone_else = _fresh("agent-loop"), _fresh("someone-else")
    msgs = [{"role": "system", "content": "You are a shell agent. Reply with one command."},
            {"role": "user", "content": "Find the test that fails in this repository."}]
    first = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=8, temperature=0)
    assert not (first.model_extra or {}).get("contextkit")  # one turn, no documents: a plain prefill
    cached = []
    for t, out in enumerate(["FAILED tests/test_io.py::test_read - 1 != 2",
                             "def test_read():\n    assert read() == 2"]):
        msgs += [{"role": "assistant", "content": f"step {t}: pytest -x"}, {"role": "tool", "content": out}]
        r = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=8, temperature=0,
                                           extra_body={"contextkit": {"tenant": agent}})
        ext = r.model_extra["contextkit"]
        assert ext["recomputed_tokens"] == 0 and ext["reused_tokens"] == ext["cached_tokens"]  # exact only
        assert r.usage.prompt_tokens_details.cached_tokens == ext["cached_tokens"]
        cached.append(ext["cached_tokens"])
    # the second turn finds the first one's conversation: at least the system prompt, task and first step
    assert cached[0] == 0 and cached[1] > 0
    other = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=2, temperature=0,
                                           extra_body={"contextkit": {"tenant": someone_else}})
    assert other.model_extra["contextkit"]["cached_tokens"] == 0  # another tenant's history is not reused


def test_documents_become_spans_reused_by_the_next_request(served, repo):
    s, kit, client = served
    tenant = _fresh("docs")  # its own tenant: the documents are cold here whatever ran before
    ex = json.loads((repo / "examples" / "question.json").read_text())
    docs = ex["documents"]
    msgs = [{"role": "user", "content": ex["question"]}]
    first = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"documents": docs, "contextkit": {"tenant": tenant}})
    ext = first.model_extra["contextkit"]
    assert ext["span_misses"] >= len(docs) and ext["policy"] == "query_attention"
    # documents with no KV yet are computed in the request's context: nothing reused, nothing cached
    assert first.usage.prompt_tokens_details.cached_tokens == ext["cached_tokens"] == ext["reused_tokens"] == 0
    assert ext["prefilled_tokens"] == first.usage.prompt_tokens and ext["compiled_tokens"] == 0
    # ... and compiled position-free while the engine is idle, after the answer (the engine thread parks
    # once no unit of that work is left)
    assert s.app.state.serve.wait_settled(120)
    # what the facade makes of the same request, planned before serve runs it (planning records nothing)
    evidence = [Evidence(d["text"], title=d["title"]) for d in docs[::-1]]
    want = kit.plan(kit.request(ex["question"], evidence, reuse=ReuseOptions(), tenant=tenant,
                                params=SamplingParams(max_new_tokens=16)))
    again = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"documents": docs[::-1], "return_token_ids": True,
                                                       "contextkit": {"tenant": tenant}})  # another order: same spans
    ext2 = again.model_extra["contextkit"]
    assert ext2["span_hits"] >= len(docs) and ext2["span_misses"] <= 1  # only the system prefix may be new
    assert again.usage.prompt_tokens_details.cached_tokens == ext2["cached_tokens"] > 0
    # the facade's request for the same question and policy: the same tokens in the same order, reused
    # under the same policy (the KV it then computes is held to full prefill by tests/spans)
    assert again.choices[0].model_extra["prompt_token_ids"] == list(want.ids)
    assert ext2["order"] == list(want.document_ids)
    # the default is a fidelity budget, resolved by the model's calibration profile, or without one (a fresh
    # machine) by the built-in fallback
    assert want.options.policy == "budget" and ext2["fidelity_budget"] == want.options.budget
    if kit.spans.profile is None:
        assert (ext2["profile"], ext2["band"], ext2["tail_gate"], ext2["escalated"]) == ("none", None, None, False)
        assert (ext2["policy"], ext2["ratio"]) == (want.options.fallback().policy, want.options.fallback().ratio)
    else:
        assert ext2["profile"] == kit.spans.profile.id and ext2["band"] is not None
    other = kit.generate(ex["question"], [Evidence(d["text"], title=d["title"]) for d in docs], reuse=ReuseOptions(),
                         params=SamplingParams(max_new_tokens=2), tenant=_fresh("another-tenant"))
    assert other.reuse.misses >= len(docs) and other.reuse.hits == 0  # tenants never share span KV
    chunks = list(client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"documents": docs, "contextkit": {
                                                     "tenant": tenant, "reuse": {"policy": "full"}}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].model_extra["contextkit"]["policy"] == "full"


def test_every_entry_point_renders_the_same_tokens(served, vllm_url, config, app_thread):
    """One planner: a multi-turn conversation with documents renders to the same tokens through the
    facade, ``contextkit serve`` and the proxy (as vLLM received them), every turn kept."""
    s, kit, client = served
    msgs = [{"role": "system", "content": "Answer from the documents."},
            {"role": "user", "content": "Which tower is in Paris?"},
            {"role": "assistant", "content": "The Eiffel Tower."},
            {"role": "user", "content": "Who is it named after?"}]
    docs = [{"id": "e", "title": "Eiffel Tower", "text": "The tower is named after Gustave Eiffel."},
            {"id": "p", "title": "Paris", "text": "Paris is the capital of France."}]
    body = {"messages": msgs, "max_tokens": 2, "temperature": 0, "return_token_ids": True,
            "documents": docs, "contextkit": {"tenant": "same-tokens"}}
    served_ids = httpx.post(s.url + "/v1/chat/completions", json={"model": "smol-local", **body},
                            timeout=120).json()["choices"][0]["prompt_token_ids"]
    settings = ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir, allow_client_tenant=True)
    with app_thread(create_app(settings)) as p:
        r = httpx.post(p.url + "/v1/chat/completions", json={"model": "smol", **body}, timeout=120)
        assert r.status_code == 200, r.text
        proxied_ids = r.json()["choices"][0]["prompt_token_ids"]  # what vLLM itself received
    request = kit.request(msgs, [Evidence(d["text"], id=d["id"], title=d["title"]) for d in docs],
                          tenant="facade-fresh")
    facade_ids = kit.plan(request).ids
    assert served_ids == proxied_ids == facade_ids
    text = kit.tokenizer.decode(facade_ids)
    assert "Which tower is in Paris?" in text and "The Eiffel Tower." in text and "Gustave Eiffel" in text


def test_the_tenant_comes_from_the_api_key(served, app_thread, repo):
    """With keys, serve takes the tenant from the key: 401 without one, 403 for a body naming another
    tenant, and one tenant's spans never show up in another's reuse report."""
    _, kit, _ = served
    keys = {"key-acme-0001": _fresh("acme"), "key-globex-01": _fresh("globex")}  # cold: nothing of other tests
    ex = json.loads((repo / "examples" / "question.json").read_text())
    body = {"model": "k", "max_tokens": 2, "temperature": 0, "documents": ex["documents"],
            "messages": [{"role": "user", "content": ex["question"]}]}
    with app_thread(create_serve_app(kit, "k", Tenancy(keys))) as s:
        def post(b, key=None):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            return httpx.post(s.url + "/v1/chat/completions", json=b, headers=headers, timeout=120)

        r = post(body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert post({**body, "contextkit": {"tenant": "globex"}}, "key-acme-0001").status_code == 403
        acme = post(body, "key-acme-0001").json()["contextkit"]
        again = post(body, "key-acme-0001").json()["contextkit"]
        globex = post(body, "key-globex-01").json()["contextkit"]
        assert again["span_hits"] >= len(ex["documents"]) and again["span_misses"] == 0
        assert globex["span_hits"] == 0 and globex["span_misses"] == acme["span_misses"]  # nothing of acme's


def test_plain_chat_completions_models_and_metrics(served):
    s, kit, client = served
    assert [m.id for m in client.models.list().data] == ["smol-local"]
    a = client.chat.completions.create(model="smol-local", messages=[{"role": "user", "content": "Say hi."}],
                                       max_tokens=8, temperature=0)
    assert a.choices[0].message.content and a.usage.completion_tokens <= 8
    c = client.completions.create(model="smol-local", prompt="The capital of France is", max_tokens=4, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="smol-local", prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if ch.choices)
    assert streamed == c.choices[0].text
    m = httpx.get(s.url + "/metrics").text
    assert "contextkit_serve_requests_total" in m and 'contextkit_kvstore_hits_total{tier="memory"}' in m
    assert 'contextkit_serve_ttft_seconds_bucket{le="+Inf"}' in m


def test_bad_requests(served):
    s, kit, client = served
    q = [{"role": "user", "content": "q"}]
    for extra, status in (({"documents": [{"title": "x"}]}, 422),
                          ({"documents": [{"text": "x"}], "contextkit": {"reuse": {"policy": "magic"}}}, 422),
                          ({"documents": [{"text": "word " * 9000}]}, 413)):
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="smol-local", messages=q, max_tokens=4, extra_body=extra)
        assert err.value.status_code == status, extra
    r = httpx.post(s.url + "/v1/completions", content=b"[1,2", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(s.url + "/health").status_code == 200


def test_serve_command_answers_and_stops_cleanly(config):
    import os
    import signal
    import subprocess
    import sys
    import time

    from contextkit.integrations.launchers.vllm_server import free_port, health

    port = free_port()
    env = dict(os.environ, CONTEXTKIT_CACHE_DIR=str(config.cache_dir))
    exe = os.path.join(os.path.dirname(sys.executable), "contextkit")
    proc = subprocess.Popen([exe, "serve", "--port", str(port), "--cache-dir", str(config.cache_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not health(f"http://127.0.0.1:{port}") and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": "contextkit", "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Who is it named after?"}],
            "documents": [{"title": "Eiffel Tower", "text": "It is named after the engineer Gustave Eiffel."}]})
        assert r.status_code == 200 and r.json()["contextkit"]["prefilled_tokens"] > 0
    finally:
        proc.send_signal(signal.SIGTERM)  # uvicorn drains, then re-raises the signal: exit status 143
        assert proc.wait(60) in (0, 143, -signal.SIGTERM)  # drained, then exited on the signal
        assert "Traceback" not in proc.stderr.read()


def _metric(url: str, name: str, labels: str = "") -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.split()[-1])
    return 0.0


def test_a_full_queue_is_429_and_a_client_that_hangs_up_frees_the_engine(served, app_thread):
    """One engine, bounded: with the queue full the next client gets 429 + Retry-After at once; a client
    that disconnects mid-stream stops its generation at the next token (counted), freeing the engine."""
    _, kit, _ = served
    # min_tokens: the answer runs to 2000 tokens whatever the model says (on one CPU it ended early)
    long = {"model": "k", "messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": 2000, "min_tokens": 2000, "temperature": 0, "stream": True}
    with app_thread(create_serve_app(kit, "k", limits=ServeLimits(max_queue=1))) as s:
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=long, timeout=120) as r:
            lines = r.iter_lines()  # kept: a line iterator dropped closes its stream (the client hangs up)
            next(lines)  # generating now
            busy = httpx.post(s.url + "/v1/chat/completions", json={**long, "stream": False}, timeout=30)
            assert busy.status_code == 429 and busy.headers["retry-after"] == "2"
            assert busy.json()["error"]["type"] == "rate_limit_error"
            lines.close()
        # hung up after the first event: the job ends at its next turn, long before 2000 tokens (~2 min on
        # this CPU), and is released (a bound that only a job decoding to the end would reach)
        assert s.app.state.serve.wait_settled(60)
        assert not s.app.state.pending
        assert _metric(s.url, "contextkit_serve_cancelled_total", '{why="disconnect"}') == 1
        ok = httpx.post(s.url + "/v1/chat/completions",
                        json={**long, "stream": False, "max_tokens": 2, "min_tokens": 0}, timeout=60)
        assert ok.status_code == 200


def test_one_tenant_cannot_starve_another(served, app_thread):
    """Requests take turns token by token, the turn going to the tenant served least: a short request of
    globex finishes while acme's long answers stream on (one at a time in arrival order, it waited for
    all of them); acme filling its share of the queue gets 429, globex still gets in."""
    _, kit, _ = served

    def chat(tenant: str, max_tokens: int, stream: bool) -> dict:
        return {"model": "k", "messages": [{"role": "user", "content": "Count from one to one thousand."}],
                "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0, "stream": stream,
                "contextkit": {"tenant": tenant}}  # min_tokens: long answers stay long whatever the model says

    limits = ServeLimits(max_queue=8, max_queue_per_tenant=3, max_active=4)
    app = create_serve_app(kit, "k", Tenancy(allow_client_tenant=True), limits)
    with app_thread(app) as s, contextlib.ExitStack() as streams:
        long = [streams.enter_context(httpx.stream("POST", s.url + "/v1/chat/completions",
                                                   json=chat("acme", 400, True), timeout=300)) for _ in range(3)]
        for r in long:
            assert r.status_code == 200
        lines = [r.iter_lines() for r in long]
        for it in lines:
            next(it)  # each of acme's answers is decoding
        full = httpx.post(s.url + "/v1/chat/completions", json=chat("acme", 2, False), timeout=30)
        assert full.status_code == 429 and "of this tenant" in full.json()["error"]["message"]
        short = httpx.post(s.url + "/v1/chat/completions", json=chat("globex", 4, False), timeout=300)
        assert short.status_code == 200, short.text
        queued = [job.tenant.name for job in tuple(s.app.state.pending)]  # a snapshot (changed on the loop)
        assert queued.count("acme") == 3  # every acme answer still streams (globex's may be being released)
        for it in lines:
            assert not any(line == "data: [DONE]" for line in itertools.islice(it, 3))


def test_a_request_past_its_deadline_is_stopped(served, app_thread):
    _, kit, _ = served
    body = {"model": "k", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 500,
            "min_tokens": 500, "temperature": 0}
    with app_thread(create_serve_app(kit, "k", limits=ServeLimits(deadline_s=0.5))) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 504 and "deadline" in r.json()["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        errors = [json.loads(e[5:]) for e in events if '"error"' in e]
        assert errors and errors[0]["error"]["code"] == 504 and events[-1] == "data: [DONE]"
        assert s.app.state.serve.wait_settled(60)  # both released (and counted) on the event loop
        assert _metric(s.url, "contextkit_serve_cancelled_total", '{why="deadline"}') == 2


MALFORMED = [  # each was a 500 or a hang before: every one must get a 4xx OpenAI error, at once
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stop": [1], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "seed": "x", "stream": True}),
    ("/v1/completions", {"prompt": [100000000000000000000], "max_tokens": 2}),
    ("/v1/completions", {"prompt": [-1], "max_tokens": 2}),
    ("/v1/completions", {"prompt": [10 ** 6], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": "a"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "max_tokens": [1]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stream_options": "x"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stop": 5}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "stop": ["a"] * 17}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}],
                              "documents": [{"text": "x"}] * 1025}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q\x00contextkit-documents\x00"}],
                              "documents": [{"text": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "n": 2, "max_tokens": 2}),  # fuzz
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "q"}], "temperature": float("nan")}),  # fuzz
]
# valid requests the fuzz run (test_fuzz.py) found answered 500 (a NaN distribution): they get 200
EXTREME_SAMPLING = [{"prompt": "q", "top_p": 5e-324, "max_tokens": 2, "temperature": 1},
                    {"prompt": "q", "temperature": 3.2e16, "top_p": 5e-324, "max_tokens": 2}]


def test_client_mistakes_are_4xx_never_500_or_a_hang(served):
    s, _, _ = served
    bodies = [(path, json.dumps(body).encode()) for path, body in MALFORMED]
    bodies += [("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "q"}], "max_tokens": 1e999}'),
               ("/v1/chat/completions", b"[" * 3000),
               ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "q"}], '
                                        b'"documents": [{"text": "\\ud800"}]}')]
    for path, raw in bodies:
        r = httpx.post(s.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert 400 <= r.status_code < 500, (raw[:80], r.status_code, r.text[:200])
        assert r.json()["error"]["code"] == r.status_code, raw[:80]
    for body in EXTREME_SAMPLING:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, (body, r.text[:200])
    ok = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
        "model": "smol-local", "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}]}]})  # content parts: valid
    assert ok.status_code == 200, ok.text


def test_a_body_declared_over_the_limit_is_refused_before_it_is_read(served, app_thread):
    """A Content-Length past the limit is answered 413 at once, before any of the body arrives (the
    server used to read, and pay for, every byte up to the limit first)."""
    import socket

    _, kit, _ = served
    with app_thread(create_serve_app(kit, "k", limits=ServeLimits(max_body_bytes=1000))) as s:
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: 100000000\r\n\r\n{")  # 100 MB announced, one byte sent
            head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_a_finished_request_frees_its_kv_at_once(served, app_thread):
    """A request's KV cache is freed when its answer is sent, not at the next full garbage collection:
    a callback closing over its job made a reference cycle, and serve's RSS climbed by gigabytes under
    load until the collector ran (found by bench robustness)."""
    import gc

    from contextkit.core.kvcache import KVCache

    _, kit, _ = served
    body = {"model": "k", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2}
    with app_thread(create_serve_app(kit, "k")) as s:
        gc.collect()
        gc.disable()
        try:
            for stream in (False, True, False):
                r = httpx.post(s.url + "/v1/chat/completions", json={**body, "stream": stream}, timeout=60)
                assert r.status_code == 200
            # the engine thread holds none of them and each job's release ran on the event loop: from
            # here on only a reference cycle could keep a KV cache alive
            assert s.app.state.serve.wait_settled(60)
            alive = sum(isinstance(o, KVCache) for o in gc.get_objects())
        finally:
            gc.enable()
    assert alive == 0


def test_a_key_gets_one_queue_share_however_many_sub_tenants_it_names(served, app_thread):
    """The per-tenant share of serve's queue is per API key: acme's requests under new sub-tenants count
    against acme's share (429 past it), and globex's key still gets in; a key naming more sub-tenants
    than the server allows at once gets 429 with Retry-After."""
    _, kit, _ = served

    def chat(sub: str | None, max_tokens: int, stream: bool) -> dict:
        return {"model": "k", "messages": [{"role": "user", "content": "Count from one to one thousand."}],
                "max_tokens": max_tokens, "min_tokens": max_tokens, "temperature": 0, "stream": stream,
                **({"contextkit": {"tenant": sub}} if sub else {})}

    keys = {"key-acme-0001": "acme", "key-globex-01": "globex"}
    acme, globex = ({"authorization": f"Bearer {k}"} for k in keys)
    limits = ServeLimits(max_queue=8, max_queue_per_tenant=2, max_active=4, rate=RateLimit())
    app = create_serve_app(kit, "k", Tenancy(keys, allow_client_tenant=True), limits)
    with app_thread(app) as s, contextlib.ExitStack() as streams:
        long = [streams.enter_context(httpx.stream("POST", s.url + "/v1/chat/completions", headers=acme,
                                                   json=chat(sub, 400, True), timeout=300)) for sub in ("s0", "s1")]
        lines = [r.iter_lines() for r in long]  # kept: a line iterator closed closes its stream
        for r, it in zip(long, lines):
            assert r.status_code == 200
            next(it)  # decoding
        for sub in ("s2", None):  # a new sub-tenant, or the key's own tenant: acme's share is full
            full = httpx.post(s.url + "/v1/chat/completions", headers=acme, json=chat(sub, 2, False), timeout=30)
            assert full.status_code == 429 and "of this tenant" in full.json()["error"]["message"], sub
        short = httpx.post(s.url + "/v1/chat/completions", headers=globex, json=chat("s2", 2, False), timeout=300)
        assert short.status_code == 200, short.text
    capped = create_serve_app(kit, "k", Tenancy(keys, allow_client_tenant=True, max_sub_tenants=1), limits)
    with app_thread(capped) as s:  # and a key names at most max_sub_tenants of them at once
        first = httpx.post(s.url + "/v1/chat/completions", headers=acme, json=chat("s0", 1, False), timeout=300)
        assert first.status_code == 200, first.text
        more = httpx.post(s.url + "/v1/chat/completions", headers=acme, json=chat("s1", 1, False), timeout=30)
        assert more.status_code == 429 and "sub-tenants" in more.json()["error"]["message"]
        assert int(more.headers["retry-after"]) > 0


def test_metrics_take_the_metrics_key_on_a_server_with_api_keys(served, app_thread):
    """serve's /metrics follows the proxy's rule: with API keys it needs the metrics key, whoever asks
    (behind a reverse proxy every client is loopback); a tenant's key is not it."""
    _, kit, _ = served
    keys = {"key-metrics-0001": "acme"}
    with app_thread(create_serve_app(kit, "k", Tenancy(keys))) as s:
        assert httpx.get(s.url + "/metrics").status_code == 403  # no metrics key set: nobody
    metrics_key = "serve-metrics-key-01"
    with app_thread(create_serve_app(kit, "k", Tenancy(keys), metrics_key=metrics_key)) as s:
        assert httpx.get(s.url + "/metrics").status_code == 401
        assert httpx.get(s.url + "/metrics", headers={"authorization": "Bearer key-metrics-0001"}).status_code == 401
        r = httpx.get(s.url + "/metrics", headers={"authorization": f"Bearer {metrics_key}"})
        assert r.status_code == 200 and "contextkit_serve_requests_total" in r.text
