"""``contextkit serve`` with the real ``openai`` client: the OpenAI API on the built-in engine, documents
reused as spans across requests, errors as OpenAI error objects."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from contextkit import ContextKit, Evidence, ReuseOptions, SamplingParams
from contextkit.integrations.proxy import ProxySettings, create_app
from contextkit.integrations.serve import create_serve_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(config, app_thread):
    kit = ContextKit(config)
    with app_thread(create_serve_app(kit, "smol-local")) as s:
        yield s, kit, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    kit.close()


def test_documents_become_spans_reused_by_the_next_request(served, repo):
    s, kit, client = served
    ex = json.loads((repo / "examples" / "question.json").read_text())
    docs = ex["documents"]
    msgs = [{"role": "user", "content": ex["question"]}]
    first = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"documents": docs})
    ext = first.model_extra["contextkit"]
    assert ext["span_misses"] >= len(docs) and ext["policy"] == "query_attention"
    again = client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"documents": docs[::-1]})  # another order: same spans
    ext2 = again.model_extra["contextkit"]
    assert ext2["span_hits"] >= len(docs) and ext2["span_misses"] <= 1  # only the system prefix may be new
    assert again.usage.prompt_tokens_details.cached_tokens == ext2["reused_tokens"] > 0
    # the same answer as the facade gives for the same request and policy
    want = kit.generate(ex["question"], [Evidence(d["text"], title=d["title"]) for d in docs[::-1]],
                        reuse=ReuseOptions(), params=SamplingParams(max_new_tokens=16))
    assert again.choices[0].message.content == want.text
    other = kit.generate(ex["question"], [Evidence(d["text"], title=d["title"]) for d in docs], reuse=ReuseOptions(),
                         params=SamplingParams(max_new_tokens=2), tenant="another-tenant")
    assert other.reuse.misses >= len(docs) and other.reuse.hits == 0  # tenants never share span KV
    chunks = list(client.chat.completions.create(model="smol-local", messages=msgs, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"documents": docs, "contextkit": {
                                                     "reuse": {"policy": "full"}}}))
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
    with app_thread(create_app(ProxySettings(upstreams=[vllm_url], cache_dir=config.cache_dir))) as p:
        r = httpx.post(p.url + "/v1/chat/completions", json={"model": "smol", **body}, timeout=120)
        assert r.status_code == 200, r.text
        proxied_ids = r.json()["choices"][0]["prompt_token_ids"]  # what vLLM itself received
    request = kit.request(msgs, [Evidence(d["text"], d["id"], d["title"]) for d in docs], tenant="facade-fresh")
    facade_ids = kit.plan(request).ids
    assert served_ids == proxied_ids == facade_ids
    text = kit.tokenizer.decode(facade_ids)
    assert "Which tower is in Paris?" in text and "The Eiffel Tower." in text and "Gustave Eiffel" in text


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

    from contextkit.integrations.vllm_server import free_port, health

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
