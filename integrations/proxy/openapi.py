"""The proxy's OpenAPI document: the edge's base (the routes it parses itself) and every route it
forwards (``routes.py``).

Bodies of the routes it only salts and relays (responses, messages, batch, tokenize) are vLLM's to parse;
they are described here by the few fields that matter at the boundary (the model, the input, the salt,
the fields that would reach the KV connector), open to any other, so the fuzzer sends both well-formed
and broken ones.
"""

from __future__ import annotations

from contextkit.integrations.edge.openapi import CLIENT_ERRORS, UPSTREAM_ERRORS, openapi_schema, post_op, responses
from contextkit.integrations.proxy.routes import ROUTES

MEDIA = {"415": "a body that is not JSON (Content-Type other than application/json)"}
_MESSAGES = {"type": "array", "minItems": 1, "maxItems": 4, "items": {
    "type": "object", "required": ["role", "content"],
    "properties": {"role": {"enum": ["user", "assistant", "system"]}, "content": {"type": "string", "maxLength": 200}}}}
_BOUNDARY = {"cache_salt": {"type": "string"}, "kv_transfer_params": {"type": "object"},
             "vllm_xargs": {"type": "object"}, "model": {"type": "string"}}
# the bodies the proxy relays to vLLM after salting them: what matters at the boundary, open to the rest
RELAYED = {
    "/v1/chat/completions/batch": {"required": ["model", "messages"], "properties": {
        "messages": {"type": "array", "minItems": 1, "maxItems": 2, "items": _MESSAGES},
        "max_tokens": {"type": "integer"}}},
    "/v1/responses": {"required": ["model", "input"], "properties": {
        "input": {"type": "string", "maxLength": 200}, "max_output_tokens": {"type": "integer"},
        "previous_response_id": {"type": "string"}, "store": {"type": "boolean"}}},
    "/v1/messages": {"required": ["model", "messages", "max_tokens"], "properties": {
        "messages": _MESSAGES, "max_tokens": {"type": "integer"}}},
    "/v1/messages/count_tokens": {"required": ["model", "messages"], "properties": {"messages": _MESSAGES}},
    "/tokenize": {"required": ["prompt"], "properties": {"prompt": {"type": "string", "maxLength": 200},
                                                         "add_special_tokens": {"type": "boolean"}}},
    "/detokenize": {"required": ["tokens"], "properties": {
        "tokens": {"type": "array", "maxItems": 16, "items": {"type": "integer", "minimum": 0}}}},
}


def _proxy_paths(paths: dict, errors: dict[str, str]) -> None:
    """The routes the proxy only relays (salted where they generate), and the ones it answers 404."""
    for route in ROUTES.values():
        if route.path in paths:
            continue
        if route.method == "GET":
            paths[route.path] = {"get": {"summary": "the upstream's", "security": [{"bearer": []}],
                                         "responses": responses({k: errors[k]
                                                                 for k in ("401", "429", *UPSTREAM_ERRORS)})}}
            continue
        shape = RELAYED[route.path]
        body = {"type": "object", "required": shape["required"], "properties": {**_BOUNDARY, **shape["properties"]}}
        what = "relayed to the upstream with the tenant's cache_salt" if route.generates else "relayed to the upstream"
        paths[route.path] = post_op(body, {**errors, **MEDIA}, what)



def proxy_openapi_schema() -> dict:
    """OpenAPI 3.1 for the proxy: what it parses itself, what it relays, and the 415 it answers a body
    that is not JSON."""
    doc = openapi_schema("proxy")
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        paths[path]["post"]["responses"].update(responses(MEDIA))
    _proxy_paths(paths, {**CLIENT_ERRORS, **UPSTREAM_ERRORS})
    return doc
