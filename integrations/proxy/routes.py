"""The proxy's boundary with vLLM: which routes it forwards, and what it makes of a body before it does.

The proxy is an allow-list, read off the routes of the installed vLLM (0.32; ``tests/integrations/proxy/
test_proxy_boundary.py`` checks this table against the OpenAPI document of the real server):

- **generation routes** run the model on the body, so they share the upstream's prefix cache and KV
  connector: every one of them gets the tenant's ``cache_salt`` from the server (a client's own is mixed
  in, never sent as it is). vLLM 0.32 generates on ``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/chat/completions/batch``, ``/v1/responses`` and ``/v1/messages`` (Anthropic's API);
- **safe routes** touch no cache: the model list, the version, tokenizing and counting tokens;
- **anything else** is a 404: vLLM's stored responses (``GET /v1/responses/{id}``: not kept per tenant),
  its development and weight-update routes, routes a later vLLM adds (they stay closed until someone reads
  what they do and adds them here).

Every body the proxy forwards is a JSON object it parsed itself (one ``Content-Type``, ``application/json``
whatever its case, else 400/415), re-serialized from what it checked, so vLLM never reads a field the
proxy did not see. No client field reaches the KV connector: ``kv_transfer_params`` and
``ec_transfer_params`` (vLLM hands both to its connectors), at the top level or smuggled through
``vllm_xargs`` (which vLLM copies into the same ``extra_args``), are removed; only the proxy's own
documents route sets them. The connector's echo (``kv_transfer_params`` in a completion) is removed from
answers too (``scrub_answer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from contextkit.core.errors import InputError, MalformedBodyError, UnsupportedMediaTypeError

# vLLM reads both from the body (and from vllm_xargs) into the request its connectors see
CONNECTOR_FIELDS = ("kv_transfer_params", "ec_transfer_params")


@dataclass(frozen=True, slots=True)
class Route:
    """One route the proxy forwards. ``generates``: the upstream runs the model on the body (salted)."""

    method: str
    path: str
    generates: bool = False

    @property
    def has_body(self) -> bool:
        return self.method == "POST"


_ROUTES = (
    Route("POST", "/v1/completions", generates=True),
    Route("POST", "/v1/chat/completions", generates=True),
    Route("POST", "/v1/chat/completions/batch", generates=True),
    Route("POST", "/v1/responses", generates=True),
    Route("POST", "/v1/messages", generates=True),
    Route("POST", "/v1/messages/count_tokens"),
    Route("POST", "/tokenize"),
    Route("POST", "/detokenize"),
    Route("GET", "/v1/models"),
    Route("GET", "/version"),
)
ROUTES: dict[tuple[str, str], Route] = {(r.method, r.path): r for r in _ROUTES}
OURS = ("GET /health", "GET /metrics")


def route_of(method: str, path: str) -> Route | None:
    """The route a request takes, or None (the proxy answers 404)."""
    return ROUTES.get((method, path))


def not_found_message(method: str, path: str) -> str:
    routes = ", ".join([f"{r.method} {r.path}" for r in _ROUTES] + list(OURS))
    return f"{method} {path[:200]}: not found; the proxy serves {routes}"


def media_type(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The body's media type, lower-cased without parameters (None: no Content-Type). Two Content-Type
    headers are refused: a server and a proxy may each read a different one."""
    values = [v for k, v in headers if k.lower() == b"content-type"]
    if len(values) > 1:
        raise MalformedBodyError(f"the request has {len(values)} Content-Type headers; send one "
                                 "(Content-Type: application/json)")
    if not values:
        return None
    return values[0].decode("latin-1").split(";", 1)[0].strip().lower()


def check_json(headers: Iterable[tuple[bytes, bytes]]) -> None:
    """Every body the proxy forwards is JSON: a missing Content-Type is taken as JSON (curl's ``-d``
    sends a form type, most clients none), any other is refused with 415."""
    kind = media_type(headers)
    if kind is not None and kind != "application/json":
        raise UnsupportedMediaTypeError(f"Content-Type {kind[:80]!r} is not accepted; send the body as JSON "
                                        "with Content-Type: application/json")


def strip_connector_fields(body: dict) -> list[str]:
    """Remove what would reach vLLM's KV connectors from a client body; the names removed."""
    removed = [name for name in CONNECTOR_FIELDS if name in body]
    for name in removed:
        del body[name]
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict):
        removed += [f"vllm_xargs.{name}" for name in CONNECTOR_FIELDS if name in xargs]
        for name in CONNECTOR_FIELDS:
            xargs.pop(name, None)
    return removed


def salt_body(route: Route, body: dict, salt_of) -> None:
    """Set the server's ``cache_salt`` on a generation route's body (``salt_of(client_salt)`` derives it)
    and close what would let a response depend on another request's stored state."""
    own = body.get("cache_salt")
    if own is not None and not isinstance(own, str):
        raise InputError("cache_salt must be a string", "cache_salt")
    body["cache_salt"] = salt_of(own)
    if route.path == "/v1/responses":
        # vLLM's response store is one namespace for every tenant: a stored response could be continued
        # (previous_response_id) or read back by anyone who learns its id
        if body.get("previous_response_id") is not None:
            raise InputError("previous_response_id is not supported through this proxy (vLLM's response store "
                             "is not kept per tenant); send the earlier turns in `input`", "previous_response_id")
        body["store"] = False


def _count(value, name: str) -> int:
    """A count as vLLM's models would read it (pydantic's lax int: ``64``, ``64.0``, ``"64"``), or
    ``InputError``: the proxy checks the value vLLM will act on, not the JSON type it came as."""
    if isinstance(value, bool):
        raise InputError(f"{name} must be an integer, not a boolean", name)
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        n = int(value.strip())
    else:
        raise InputError(f"{name} must be an integer, got {str(value)[:40]!r}", name)
    if n < 1:
        raise InputError(f"{name} must be at least 1, got {n}", name)
    return n


def prompts_of(path: str, body: dict) -> int:
    """How many prompts one request asks vLLM to run: a completion's list of prompts (strings or token-id
    lists), the batch route's list of conversations; 1 otherwise."""
    if path == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt):
            return len(prompt)  # a list of strings or of token-id lists: one prompt each
    elif path == "/v1/chat/completions/batch":
        messages = body.get("messages")
        if isinstance(messages, list) and messages and all(isinstance(m, list) for m in messages):
            return len(messages)
    return 1


def longest_ids_prompt(path: str, body: dict) -> int:
    """The longest token-id prompt of a completion request (a list of ids, or a list of such lists); 0 when
    it has none (text prompts are measured by vLLM)."""
    if path != "/v1/completions":
        return 0
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return 0
    if all(type(t) is int for t in prompt):
        return len(prompt)
    return max((len(p) for p in prompt if isinstance(p, list)), default=0)


def cap_fan_out(path: str, body: dict, max_n: int) -> int:
    """Check what a generation request fans out to: its choices in all, prompts x ``n`` (and ``best_of``
    where vLLM takes it), at most ``max_n``; the body's counts are rewritten as the integers checked, so
    what vLLM reads is what was counted. Raises ``InputError`` (422) past the cap or for a count that is
    no integer. Returns the choices."""
    counts = {}
    for name in ("n", "best_of"):
        if body.get(name) is not None:
            counts[name] = body[name] = _count(body[name], name)
    prompts = prompts_of(path, body)
    choices = prompts * max(counts.values(), default=1)
    if choices > max_n:
        what = f"{prompts} prompts x n={counts.get('n', 1)}" if prompts > 1 else f"n={max(counts.values())}"
        raise InputError(f"{what} is {choices} choices, over this proxy's limit of {max_n} per request; send "
                         "several requests, or ask the operator to raise max_n", "n")
    return choices


def scrub_answer(content: bytes) -> bytes:
    """A non-streamed answer without the connectors' echo (``kv_transfer_params``: what the connector
    loaded, an 'is this stored' oracle no client needs; ``ec_transfer_params``). vLLM sends them only
    in whole answers; bodies without them are returned as they are."""
    if b"_transfer_params" not in content:
        return content
    try:
        obj = json.loads(content)
    except ValueError:
        return content
    if not isinstance(obj, dict) or not any(name in obj for name in CONNECTOR_FIELDS):
        return content
    for name in CONNECTOR_FIELDS:
        obj.pop(name, None)
    return json.dumps(obj).encode()
