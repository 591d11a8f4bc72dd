"""The proxy/vLLM boundary under ``bench robustness``: abuse cases and leak probes for what a client could
send past the proxy to vLLM (``integrations/proxy/routes.py``).

Abuse (sent by the abuser process among the hand-made cases): ``kv_transfer_params`` naming an unsalted
connector namespace or a pic load, the same smuggled through ``vllm_xargs``; every generation route of
vLLM 0.32 (responses, messages, the batch route) with another tenant's name as ``cache_salt``; routes
outside the allow-list (vLLM's stored responses, its cache reset); header tricks (``Application/JSON``,
two Content-Type headers, a form type). A case marked ``must_refuse`` answered 2xx counts as a leak.

Probes (after the abuse, per generation route that reports cached tokens): a good tenant sends a new
prompt, the probe tenant sends the same prompt with that tenant's name as ``cache_salt`` and connector
params naming the empty salt; any cached token, or a ``kv_transfer_params`` echo in its answer, is a
cross-tenant leak. The good tenant then sends it again: its own cached tokens show the probe could have
seen a hit (``route_probe_armed``), so a 0 is not a probe that could not fail.
"""

from __future__ import annotations

import functools
import json
import uuid

# a client asking the connector for the unsalted namespace and approximate KV under its own salt
HOSTILE = {"kv_transfer_params": {"contextkit": {"mode": "pic", "salt": "", "spans": [[0, 2]]}},
           "ec_transfer_params": {"x": 1}}
SMUGGLED = {"vllm_xargs": {"kv_transfer_params": "x"}}
GENERATION = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")


def body_for(path: str, model: str, text: str, max_tokens: int = 2) -> dict:
    """A minimal request of ``text`` on a generation route."""
    msgs = [{"role": "user", "content": text}]
    if path == "/v1/completions":
        return {"model": model, "prompt": text, "max_tokens": max_tokens}
    if path == "/v1/responses":
        return {"model": model, "input": text, "max_output_tokens": max_tokens}
    if path == "/v1/chat/completions/batch":
        return {"model": model, "messages": [msgs, msgs], "max_tokens": max_tokens}
    return {"model": model, "messages": msgs, "max_tokens": max_tokens}


def cached_tokens(path: str, answer: dict) -> int:
    """The prompt tokens vLLM served from its prefix cache, as each route reports them."""
    usage = answer.get("usage") or {}
    if path == "/v1/responses":
        return int((usage.get("input_tokens_details") or {}).get("cached_tokens") or 0)
    if path == "/v1/messages":
        return int(usage.get("cache_read_input_tokens") or 0)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def abuse_cases(http, model: str, me: str) -> list[tuple[str, bytes, dict]]:
    """(kind, raw request, how) of one round of boundary abuse; ``http(path, body, key, ctype, extra)``
    builds a raw HTTP/1.1 request."""
    out = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = body_for(path, model, "Hello")
        out.append(("injected", http(path, json.dumps({**body, **HOSTILE}).encode(), me), {}))
        out.append(("injected", http(path, json.dumps({**body, **SMUGGLED}).encode(), me), {}))
    for path in ("/v1/responses", "/v1/messages", "/v1/chat/completions/batch"):
        body = {**body_for(path, model, "Hello"), "cache_salt": "good0", **HOSTILE}
        out.append(("routes", http(path, json.dumps(body).encode(), me), {}))
    out.append(("routes", http("/v1/responses", json.dumps({**body_for("/v1/responses", model, "Hi"),
                                                            "previous_response_id": "resp_0"}).encode(), me),
                {"must_refuse": True}))
    for method, path in (("GET", "/v1/responses/resp_0"), ("POST", "/reset_prefix_cache"),
                         ("POST", "/v1/systemone"), ("GET", "/v1/models%2F..%2Fmetrics")):
        raw = http(path, b"{}", me).replace(b"POST ", f"{method} ".encode(), 1)
        out.append(("routes", raw, {"must_refuse": True}))
    out += fan_out_cases(http, model, me)
    docs = [{"id": f"d{i}", "text": f"Entry {i} of the ledger, filed under {i * 7919 % 1000}."} for i in range(300)]
    planning = {**body_for("/v1/chat/completions", model, "Which entry?"), "documents": docs}
    out.append(("planning", http("/v1/chat/completions", json.dumps(planning).encode(), me), {}))
    plain = json.dumps({**body_for("/v1/completions", model, "Hello"), "cache_salt": "good0"}).encode()
    out.append(("headers", http("/v1/completions", plain, me, "Application/JSON"), {}))
    out.append(("headers", http("/v1/completions", plain, me, "application/json", "content-type: text/plain\r\n"),
                {"must_refuse": True}))
    out.append(("headers", http("/v1/completions", plain, me, "application/x-www-form-urlencoded"),
                {"must_refuse": True}))
    return out


def fan_out_cases(http, model: str, me: str) -> list[tuple[str, bytes, dict]]:
    """Choices past the proxy's ``max_n`` (16) by value rather than by JSON type: ``n`` as a string or a
    float, a completion's list of prompts times n, the batch route's conversations times n."""
    out = []
    for path in ("/v1/completions", "/v1/chat/completions"):
        for n in ("64", 64.0):
            out.append(("fanout", http(path, json.dumps({**body_for(path, model, "Hi"), "n": n}).encode(), me),
                        {"must_refuse": True}))
    many = {**body_for("/v1/completions", model, "Hi"), "prompt": ["Hi"] * 64, "n": 4}
    out.append(("fanout", http("/v1/completions", json.dumps(many).encode(), me), {"must_refuse": True}))
    batch = {**body_for("/v1/chat/completions/batch", model, "Hi"), "n": "8"}
    batch["messages"] = batch["messages"] * 8
    out.append(("fanout", http("/v1/chat/completions/batch", json.dumps(batch).encode(), me), {"must_refuse": True}))
    return out


@functools.lru_cache(maxsize=2)  # built once per process: ~1M ids
def large_ids_body(model: str, max_body: int) -> bytes:
    """A completion of token ids filling most of ``max_body`` (~1M ids in 8 MiB): what the proxy parses,
    renders and serializes off its event loop; vLLM refuses it as too long."""
    n = int(max_body * 0.9) // 7  # "12345, " is ~7 bytes an id
    return json.dumps({"model": model, "prompt": [(i * 7919) % 30000 + 100 for i in range(n)],
                       "max_tokens": 1}).encode()


def route_probes(post, model: str, probes: int, good: int) -> tuple[int, int, int, list[str]]:
    """(requests, leaks, armed, what leaked): each probe tenant tries each generation route on a good
    tenant's new prompt. ``post(path, body, key) -> (status, json)``."""
    sent = leaks = armed = 0
    what: list[str] = []
    for j in range(probes):
        path = GENERATION[j % len(GENERATION)]
        g = j % good
        text = f"{uuid.uuid4()} " + "The committee met to review the annual budget and its many lines. " * 10
        body = body_for(path, model, text)
        mine, theirs = f"key-good-{g:02d}", f"key-probe-{j:03d}"
        post(path, body, mine)
        status, out = post(path, {**body, "cache_salt": f"good{g}", **HOSTILE}, theirs)
        again_status, again = post(path, body, mine)
        sent += 3
        if status != 200:
            what.append(f"route probe {j} ({path}): status {status}")
            continue
        if cached_tokens(path, out) or out.get("kv_transfer_params") is not None:
            leaks += 1
            what.append(f"route probe {j} ({path}): cached {cached_tokens(path, out)}, "
                        f"echo {out.get('kv_transfer_params')}")
        armed += int(again_status == 200 and cached_tokens(path, again) > 0)
    return sent, leaks, armed, what
