"""Fuzz a running ``serve`` or proxy from its OpenAPI document (``integrations.openapi``) with schemathesis.

Cases are drawn by hypothesis from schemathesis's strategies, both valid bodies and ones that break the
schema (wrong types, missing fields, values out of range, non-JSON), with and without the API key, and
sent to the real server over HTTP. A case fails when the server hangs (no answer within ``timeout_s``),
answers a status its document does not list (a 500 above all; 502/503/504 are documented where an upstream
or a deadline is involved), answers an error that is not an OpenAI error object, or a 401 without
``WWW-Authenticate``. ``make test`` runs a bounded number of cases against both servers
(``tests/integrations/test_fuzz.py``); ``bench robustness`` runs it for minutes under load.

Valid generation requests ask for at most ``max_tokens_cap`` tokens (a larger or missing ``max_tokens`` is
set to it): what is under test is parsing and error handling, and a 2k-token answer per case would spend
the run's minutes on decoding.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

from contextkit.integrations.edge.openapi import openapi_schema
from contextkit.integrations.proxy.openapi import proxy_openapi_schema

GENERATION = ("/v1/chat/completions", "/v1/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages")


@dataclass(frozen=True, slots=True)
class Finding:
    """One case the server got wrong."""

    path: str
    status: int | None  # None: no answer (a hang or a dropped connection)
    problem: str
    body: str  # the request body, cut to 600 characters

    def __str__(self) -> str:
        return f"{self.path} -> {self.status}: {self.problem}; body: {self.body}"


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)  # (path, status) -> count
    findings: list[Finding] = field(default_factory=list)
    documented_5xx: list[Finding] = field(default_factory=list)  # 502/503/504: allowed, kept to be read
    hangs: int = 0

    @property
    def server_errors(self) -> int:
        return sum(n for (_, s), n in self.statuses.items() if s >= 500 and s not in (502, 503, 504))


def documented(server: str) -> dict[str, set[int]]:
    """The statuses each path may answer, from the server's OpenAPI document. The proxy relays every route
    but its own two to vLLM, which adds its own 400 and 404 (an unknown ``model``)."""
    spec = _schema(server)
    out = {}
    for path, ops in spec["paths"].items():
        for op in ops.values():
            out[path] = {int(s) for s in op["responses"]}
            if server == "proxy" and path not in ("/health", "/metrics"):
                out[path] |= {400, 404}
    return out


def _cap(body, cap: int):
    """A generation body that asks for more than ``cap`` tokens (or does not say) asks for ``cap``."""
    if isinstance(body, dict):
        name = "max_output_tokens" if "input" in body else "max_tokens"  # /v1/responses names it so
        mt = body.get(name)
        if mt is None or (type(mt) in (int, float) and mt > cap):  # 3946.0 is an integer to pydantic and vLLM
            body = {**body, name: cap}
        mct = body.get("max_completion_tokens")
        if type(mct) in (int, float) and mct > cap:
            body = {**body, "max_completion_tokens": cap}
    return body


def check(path: str, response, allowed: set[int]) -> str | None:
    """What is wrong with one answer, or None."""
    status = response.status_code
    if status not in allowed:
        return f"status {status} is not in the documented set {sorted(allowed)}: {response.text[:300]}"
    if status >= 400:
        try:
            err = response.json()["error"]
            if not (isinstance(err["message"], str) and isinstance(err["type"], str)):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            return f"status {status} without an OpenAI error object: {response.text[:300]}"
        if status == 401 and not response.headers.get("www-authenticate"):
            return "401 without WWW-Authenticate"
    return None


def fuzz(url: str, server: str, examples: int, api_key: str | None = None, *, timeout_s: float = 60.0,
         max_tokens_cap: int = 4, seed: int = 0, deadline_s: float | None = None) -> FuzzReport:
    """Send ``examples`` generated cases (or as many as fit before ``deadline_s`` seconds) to ``url``."""
    import requests  # schemathesis's transport
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(_schema(server))
    strategy = st.one_of(schema.as_strategy(generation_mode=GenerationMode.POSITIVE),
                         schema.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    allowed = documented(server)
    report = FuzzReport()
    stop_at = time.monotonic() + deadline_s if deadline_s else None
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    session = requests.Session()

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case) -> None:
        if stop_at and time.monotonic() > stop_at:
            return
        if case.path in GENERATION:
            case.body = _cap(case.body, max_tokens_cap)
        shown = (case.body[:600].decode("latin-1") if isinstance(case.body, bytes)
                 else json.dumps(case.body, default=str)[:600])
        report.requests += 1
        try:
            response = case.call(base_url=url, session=session, headers=headers, timeout=timeout_s)
        except requests.Timeout:
            report.hangs += 1
            report.findings.append(Finding(case.path, None, f"no answer within {timeout_s} s", shown))
            return
        except requests.RequestException as exc:
            report.findings.append(Finding(case.path, None, f"connection failed: {exc}", shown))
            return
        report.statuses[(case.path, response.status_code)] += 1
        problem = check(case.path, response, allowed[case.path])
        if problem:
            report.findings.append(Finding(case.path, response.status_code, problem, shown))
        elif response.status_code >= 500:
            report.documented_5xx.append(Finding(case.path, response.status_code, response.text[:300], shown))

    one()
    session.close()
    return report


def _schema(server: str) -> dict:
    return proxy_openapi_schema() if server == "proxy" else openapi_schema("serve")
