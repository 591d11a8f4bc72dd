"""Position-independent span reuse through the contextkit KV connector (``--kv-connector`` upstreams).

A documents request that opts in (``contextkit.reuse = {"policy": "none"}``, optionally with
``"recompute_last_span": true``) is sent with its spans' token ranges in ``kv_transfer_params``; the
connector in vLLM loads each span's position-free KV, re-rotated to its place, and vLLM computes the
rest (``integrations/vllm_connector``). This is reuse without recompute; the recompute ratio of
``contextkit serve`` does not exist on this path (docs/vllm_connector.md says what it would take).

Two namespaces keep approximate KV request-only:
- span keys are named under the tenant's salt (the one its exact requests use), so a tenant loads only
  spans compiled for it;
- the request's own ``cache_salt`` is the tenant's salt with the opt-in appended, so the blocks it
  leaves in vLLM's prefix cache (made from approximate KV) are hit only by requests with the same opt-in.

Spans the proxy has not seen compiled on an upstream are compiled after the request, off its path: one
request per span (its tokens alone, ``mode: span``), a few at a time, so the first request with a new
document is a full prefill and the next ones reuse it. A span the connector reports missing (evicted,
or the store was down) is compiled again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict

from contextkit.core.errors import InputError
from contextkit.core.plan import RequestPlan, ReuseOptions

log = logging.getLogger("contextkit.proxy")


def check_options(connector: str, fields: dict) -> None:
    """The reuse an upstream's connector offers. The request's own ``contextkit.reuse`` fields are checked
    (not the filled-in ``ReuseOptions``, whose defaults, such as serve's ``first_k=2``, are not this path's).

    ``contextkit``: without recompute, optionally recomputing the last span. ``cacheblend``: LMCache's
    KV-deviation recompute at the ratio the upstream's LMCache config sets (one per server)."""
    if connector == "cacheblend":
        if fields.get("policy") != "kv_deviation" or set(fields) - {"policy"}:
            raise InputError('this proxy\'s upstreams run LMCache\'s CacheBlend: send contextkit.reuse = {"policy": '
                             '"kv_deviation"} (the recompute ratio is the one in the upstreams\' LMCache config)',
                             "contextkit")
        return
    if fields.get("policy") != "none" or set(fields) - {"policy", "recompute_last_span"}:
        raise InputError("the proxy's KV connector path reuses spans without recompute: send contextkit.reuse = "
                         '{"policy": "none"} (optionally "recompute_last_span": true); recompute ratios run on '
                         "contextkit serve", "contextkit")


def spans_of(plan: RequestPlan) -> list[tuple[int, int]]:
    """Token ranges of the plan's position-free spans (system head, skills, documents), in prompt order.
    A conversation's earlier turns are exact-only (``PlanItem.exact``): never a span the upstream
    re-positions; its prefix cache serves them where they are a prefix."""
    out, pos = [], 0
    for item in plan.items:
        n = len(item.span.token_ids)
        if item.reuse and not item.exact and n:
            out.append((pos, pos + n))
        pos += n
    return out


def segments_of(plan: RequestPlan) -> list[tuple[int, ...]]:
    """The prompt's runs for a blending upstream: each span alone, a conversation's pieces joined to the
    run they continue (the system prompt before the documents, or one another after them), so a turn
    boundary never becomes a segment boundary."""
    out: list[tuple[int, ...]] = []
    prev = None
    for item in plan.items:
        ids, kind = item.span.token_ids, item.span.kind
        if not ids:
            continue
        if out and ((kind == "history" and prev in ("system", "history")) or (kind == "query" and prev == "history")):
            out[-1] = out[-1] + tuple(ids)
        else:
            out.append(tuple(ids))
        prev = kind
    return out


def pic_salt(salt: str, opts: ReuseOptions) -> str:
    """The ``cache_salt`` of a request reusing spans: its own namespace per opt-in."""
    return f"{salt}:pic{':last' if opts.recompute_last_span else ''}"


def pic_params(plan: RequestPlan, salt: str, opts: ReuseOptions) -> dict:
    return {"contextkit": {"mode": "pic", "spans": [list(s) for s in spans_of(plan)], "salt": salt,
                           "recompute_last": bool(opts.recompute_last_span)}}


class SpanCompiler:
    """Compiles spans on upstreams in the background; remembers (bounded) which ones it compiled.

    Args:
        post: ``async post(upstream_url, body: bytes) -> int`` (the status), the proxy's own session.
        concurrency: compiles running at once per proxy (each is a prefill on the upstream).
        remember: compiled spans kept in memory before the oldest is forgotten (and compiled again).
    """

    def __init__(self, post, concurrency: int = 2, remember: int = 65536):
        self._post = post
        self._sem = asyncio.Semaphore(concurrency)
        self._known: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self._remember = remember
        self._tasks: set[asyncio.Task] = set()
        self.compiled = 0
        self.failed = 0

    @staticmethod
    def _key(url: str, salt: str, ids) -> tuple[str, str, str]:
        return url, salt, hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def forget(self, url: str, salt: str, ids) -> None:
        self._known.pop(self._key(url, salt, ids), None)

    def schedule(self, url: str, model: str | None, salt: str, spans: list[list[int]]) -> None:
        """Compile every span in ``spans`` (token ids) this proxy has not compiled on ``url`` for ``salt``."""
        for ids in spans:
            key = self._key(url, salt, ids)
            if key in self._known:
                self._known.move_to_end(key)
                continue
            self._known[key] = None
            while len(self._known) > self._remember:
                self._known.popitem(last=False)
            body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0, "cache_salt": salt,
                    "kv_transfer_params": {"contextkit": {"mode": "span"}}}
            if model:
                body["model"] = model
            task = asyncio.create_task(self._compile(url, key, json.dumps(body).encode()))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _compile(self, url: str, key, body: bytes) -> None:
        async with self._sem:
            try:
                status = await self._post(url, body)
            except Exception as exc:  # noqa: BLE001 - a failed compile is a later miss, compiled again
                status = f"failed: {exc}"
        if status == 200:
            self.compiled += 1
            return
        self.failed += 1
        self._known.pop(key, None)
        log.warning({"span_compile": url, "status": status})

    async def idle(self) -> None:
        """Wait for the compiles scheduled so far (benchmarks and tests)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
