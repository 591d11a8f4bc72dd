"""The OpenAPI document of ``contextkit serve`` and of the proxy's own routes, made from the request shapes.

Both servers parse bodies by hand from the raw ASGI stream (a bounded read, then the pydantic shapes of
``edge.shapes``), so no framework sees their bodies and neither could describe them. This document is
built from those same pydantic models, so what it says a body may hold is what the servers accept.
``serve`` answers it at ``/openapi.json``; the proxy does not (that path is the upstream vLLM's), and
the fuzz tests and ``bench robustness`` read it from ``proxy.openapi``, which adds the routes the proxy
only relays to this base.
"""

from __future__ import annotations

from typing import Literal

from pydantic.json_schema import models_json_schema

from contextkit.integrations.edge.shapes import ChatBody, CompletionBody

REF = "#/components/schemas/{model}"
# what every route may answer beside its success; 502/503/504 only where an upstream is involved
CLIENT_ERRORS = {"400": "malformed JSON", "401": "no or unknown API key", "403": "a tenant the key may not use",
                 "413": "body or prompt too large", "422": "a field out of range or of the wrong type",
                 "429": "the tenant is over its request rate, or (serve) the engine queue is full (Retry-After)"}
UPSTREAM_ERRORS = {"502": "the upstream failed", "503": "no healthy upstream",
                   "504": "the upstream or the deadline timed out"}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": "integer"},
                   "contextkit_code": {"type": ["string", "null"]}}}}}


def responses(errors: dict[str, str]) -> dict:
    out = {"200": {"description": "OK (application/json, or text/event-stream with stream: true)"}}
    for status, what in errors.items():
        out[status] = {"description": what,
                       "content": {"application/json": {"schema": {"$ref": REF.format(model="Error")}}}}
    return out


def post_op(model: str | dict, errors: dict[str, str], summary: str) -> dict:
    schema = {"$ref": REF.format(model=model)} if isinstance(model, str) else model
    return {"post": {"summary": summary, "security": [{"bearer": []}],
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": responses(errors)}}


def openapi_schema(server: Literal["serve", "proxy"] = "serve") -> dict:
    """OpenAPI 3.1 for ``serve`` (everything it answers) or the base of the proxy's (the routes it parses
    itself: chat completions with and without documents, completions it salts, its health and metrics;
    ``proxy.openapi`` adds the routes it relays)."""
    _, defs = models_json_schema([(ChatBody, "validation"), (CompletionBody, "validation")], ref_template=REF)
    schemas = {**defs["$defs"], "Error": _ERROR}
    errors = {**CLIENT_ERRORS, **({"504": "past the request's deadline"} if server == "serve" else UPSTREAM_ERRORS)}
    authed = {k: v for k, v in errors.items() if k in ("401", "429", *UPSTREAM_ERRORS)}
    paths = {
        "/v1/chat/completions": post_op("ChatBody", errors, "chat completion; `documents` are ordered (proxy) or "
                                                          "reused as spans (serve)"),
        "/v1/completions": post_op("CompletionBody", errors, "text completion"),
        "/v1/models": {"get": {"summary": "the served model", "security": [{"bearer": []}],
                               "responses": responses(authed)}},
        "/health": {"get": {"summary": "200 when the server can answer", "responses": responses({})}},
        "/metrics": {"get": {"summary": "Prometheus text format; takes the metrics key (Bearer) where one is set, "
                                        "and is refused without it on a server with API keys",
                             "responses": {"200": {"description": "OK"},
                                           **{k: v for k, v in responses({
                                               "401": "not the metrics key",
                                               "403": "no metrics key set (a server with API keys), or a "
                                                      "non-loopback client of an open server"}).items()
                                              if k != "200"}}}},
    }
    if server == "serve":
        paths["/tokenize"] = {"post": {
            "summary": "token ids of a prompt", "security": [{"bearer": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object",
                "properties": {"prompt": {"type": "string"}, "add_special_tokens": {"type": "boolean"}}}}}},
            "responses": responses({k: v for k, v in errors.items() if k in ("400", "401", "413", "422", "429")})}}
    return {"openapi": "3.1.0",
            "info": {"title": f"contextkit {server}", "version": "1",
                     "description": "OpenAI-compatible; errors are OpenAI error objects with the statuses listed"},
            "paths": paths,
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
