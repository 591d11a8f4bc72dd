"""The OpenAPI document of ``contextkit serve`` and of the proxy's own routes, made from the request shapes.

Both servers parse bodies by hand from the raw ASGI stream (a bounded read, then the pydantic shapes of
``openai_api``), so no framework sees their bodies and neither could describe them. This document is
built from those same pydantic models, so what it says a body may hold is what the servers accept.
``serve`` answers it at ``/openapi.json``; the proxy does not (that path is the upstream vLLM's), and
the fuzz tests and ``bench robustness`` read it from here (``openapi_schema("proxy")``).

The proxy's document lists every route it forwards (``proxy.routes``). Bodies of the routes it only
salts and relays (responses, messages, batch, tokenize) are vLLM's to parse; they are described here by
the few fields that matter at the boundary (the model, the input, the salt, the fields that would reach
the KV connector), open to any other, so the fuzzer sends both well-formed and broken ones.
"""

from __future__ import annotations

from typing import Literal

from pydantic.json_schema import models_json_schema

from contextkit.integrations.openai_api import ChatBody, CompletionBody
from contextkit.integrations.proxy.routes import ROUTES

REF = "#/components/schemas/{model}"
# what every route may answer beside its success; 502/503/504 only where an upstream is involved
CLIENT_ERRORS = {"400": "malformed JSON", "401": "no or unknown API key", "403": "a tenant the key may not use",
                 "413": "body or prompt too large", "422": "a field out of range or of the wrong type",
                 "429": "the tenant is over its request rate, or (serve) the engine queue is full (Retry-After)"}
UPSTREAM_ERRORS = {"502": "the upstream failed", "503": "no healthy upstream", "504": "the upstream or the deadline timed out"}
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

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}


def _responses(errors: dict[str, str]) -> dict:
    out = {"200": {"description": "OK (application/json, or text/event-stream with stream: true)"}}
    for status, what in errors.items():
        out[status] = {"description": what, "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    return out


def _post(model: str | dict, errors: dict[str, str], summary: str) -> dict:
    schema = {"$ref": REF.format(model=model)} if isinstance(model, str) else model
    return {"post": {"summary": summary, "security": [{"bearer": []}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": _responses(errors)}}


def _proxy_paths(paths: dict, errors: dict[str, str]) -> None:
    """The routes the proxy only relays (salted where they generate), and the ones it answers 404."""
    for route in ROUTES.values():
        if route.path in paths:
            continue
        if route.method == "GET":
            paths[route.path] = {"get": {"summary": "the upstream's", "security": [{"bearer": []}],
                                         "responses": _responses({k: errors[k] for k in ("401", "429", *UPSTREAM_ERRORS)})}}
            continue
        shape = RELAYED[route.path]
        body = {"type": "object", "required": shape["required"], "properties": {**_BOUNDARY, **shape["properties"]}}
        what = "relayed to the upstream with the tenant's cache_salt" if route.generates else "relayed to the upstream"
        paths[route.path] = _post(body, {**errors, **MEDIA}, what)


def openapi_schema(server: Literal["serve", "proxy"] = "serve") -> dict:
    """OpenAPI 3.1 for ``serve`` (everything it answers) or the proxy (the routes it parses itself:
    chat completions with and without documents, completions it salts, its health and metrics)."""
    _, defs = models_json_schema([(ChatBody, "validation"), (CompletionBody, "validation")], ref_template=REF)
    schemas = {**defs["$defs"], "Error": _ERROR}
    errors = {**CLIENT_ERRORS, **({"504": "past the request's deadline"} if server == "serve" else UPSTREAM_ERRORS)}
    authed = {k: v for k, v in errors.items() if k in ("401", "429", *UPSTREAM_ERRORS)}
    paths = {
        "/v1/chat/completions": _post("ChatBody", errors, "chat completion; `documents` are ordered (proxy) or "
                                                          "reused as spans (serve)"),
        "/v1/completions": _post("CompletionBody", errors, "text completion"),
        "/v1/models": {"get": {"summary": "the served model", "security": [{"bearer": []}],
                               "responses": _responses(authed)}},
        "/health": {"get": {"summary": "200 when the server can answer", "responses": _responses({})}},
        "/metrics": {"get": {"summary": "Prometheus text format", "responses": {"200": {"description": "OK"}}}},
    }
    if server == "proxy":
        for path in ("/v1/chat/completions", "/v1/completions"):
            paths[path]["post"]["responses"].update(_responses(MEDIA))
        _proxy_paths(paths, errors)
    if server == "serve":
        paths["/tokenize"] = {"post": {
            "summary": "token ids of a prompt", "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"}}}}}},
            "responses": _responses({k: v for k, v in errors.items() if k in ("400", "401", "413", "422", "429")})}}
    return {"openapi": "3.1.0",
            "info": {"title": f"contextkit {server}", "version": "1",
                     "description": "OpenAI-compatible; errors are OpenAI error objects with the statuses listed"},
            "paths": paths,
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
