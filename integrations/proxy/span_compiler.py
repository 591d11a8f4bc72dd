"""Position-independent span reuse through the contextkit KV connector (``--kv-connector`` upstreams).

A documents request that opts in (``contextkit.reuse``: ``{}`` for the calibrated default, or a policy:
``query_attention``, ``kv_deviation``, ``first_k`` with their ratio / cap / sinks, ``none`` for no recompute,
``full`` for none of this) is sent with its spans' token ranges and its recompute setting in
``kv_transfer_params``; the connector in vLLM loads each span's position-free KV, re-rotated to its place,
recomputes the selected tokens in their new context in vLLM's worker (``integrations/vllm_connector/
repair.py``), and vLLM computes the rest.

Two namespaces keep approximate KV request-only:
- span keys are named under the tenant's salt (the one its exact requests use), so a tenant loads only
  spans compiled for it;
- the request's own ``cache_salt`` is the tenant's salt with the opt-in appended, so the blocks it
  leaves in vLLM's prefix cache (made from approximate KV) are hit only by requests with the same opt-in.

A span the store lacks is computed by vLLM in its request's prompt, and the connector saves it out of
that request as span KV (``saved_spans`` in its answer): the first request with a new document is a full
prefill and the next ones reuse that KV, which saw a real context. Spans the connector did not save and
this proxy has not seen compiled on an upstream (a streamed answer carries no ``kv_transfer_params``) are
compiled after the request, off its path: one request per span (its tokens alone, ``mode: span``), a few
at a time from a bounded backlog (a span past its bounds is dropped, counted, and scheduled again by a
later request). A span the connector reports missing (evicted, or the store was down) and did not save
is compiled again.
"""

from __future__ import annotations

import array
import asyncio
import hashlib
import json
import logging
from collections import Counter, deque
from dataclasses import dataclass

from cachetools import LRUCache
from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from contextkit.core import tenancy
from contextkit.core.errors import ConfigError, InputError
from contextkit.core.plan import RequestPlan
from contextkit.core.policy import CONNECTOR_FIELDS, CONNECTOR_POLICIES, SPECS, ReuseOptions, for_connector, variant
from contextkit.core.tenant import Tenant
from contextkit.integrations.vllm_connector.wire import RequestOptions

log = logging.getLogger("contextkit.proxy")
SPAN_COMPILE = RequestOptions(mode="span").encode()  # a span alone at position 0, saved as span KV


def check_options(fields: dict) -> None:
    """The reuse the contextkit connector offers. The request's own ``contextkit.reuse`` fields are checked
    (not the filled-in ``ReuseOptions``, whose defaults, such as serve's ``first_k=2``, are not this path's):
    the connector's policies and fields (``core.policy``); "none" takes ``recompute_last_span`` only."""
    policy = fields.get("policy", "budget")
    allowed = {"policy", "recompute_last_span"} if policy == "none" else REPAIR_FIELDS
    extra = set(fields) - allowed
    if policy not in CONNECTOR_POLICIES or extra:
        what = f"policy {policy!r}" if policy not in CONNECTOR_POLICIES else f"the fields {sorted(extra)}"
        raise InputError(f"the proxy's KV connector path does not take {what}: policies "
                         f"{', '.join(CONNECTOR_POLICIES)} (the default: budget), with "
                         f"{', '.join(sorted(REPAIR_FIELDS - {'policy'}))} (none: recompute_last_span only); "
                         "attention_budget, block_size and separator run on contextkit serve", "contextkit")


REPAIR_FIELDS = frozenset({*CONNECTOR_FIELDS, "recompute_last_span"})  # what a request may set on this path


def uses_spans(opts: ReuseOptions | None) -> bool:
    """Whether a request with these options loads span KV through the connector ("full": no reuse)."""
    return opts is not None and SPECS[opts.policy].loads


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
    """The ``cache_salt`` of a request reusing spans: its own namespace per opt-in and recompute setting
    (derived in ``core.tenancy``, which the KV connector checks it against)."""
    repair = for_connector(opts)
    return tenancy.pic_salt(salt, recompute_last=bool(opts.recompute_last_span),
                            variant=variant(repair) if repair is not None else "")


def pic_params(plan: RequestPlan, salt: str, opts: ReuseOptions, *, probe_end: int | None = None) -> dict:
    """``kv_transfer_params`` of a span-reuse request: its spans, the tenant's salt, and the recompute the
    connector runs in vLLM's worker (``core.policy.for_connector``; none for policy "none"). ``probe_end``:
    benchmarks feeding an answer back keep it out of the selection."""
    request = RequestOptions(mode="pic", spans=tuple(spans_of(plan)), salt=salt,
                             recompute_last=bool(opts.recompute_last_span), recompute=for_connector(opts))
    return request.with_probe_end(probe_end).encode()


class SpanCompiler:
    """Compiles spans on upstreams in the background, from a bounded backlog; remembers (bounded) which
    ones it compiled.

    Every span a request names that this proxy has not compiled is a compile (a prefill on the upstream),
    so a client sending new documents in a loop could grow the work without end. The backlog is bounded
    in all (``max_backlog``) and per key tenant (``max_per_tenant``, compiles queued or running; the salt
    when no tenant is given): past either, the span is dropped and counted
    (``contextkit_proxy_span_compiles_dropped{reason}``), not remembered, so a later request naming it
    schedules it again. One tenant's flood thus fills at most its share, and the others' spans still
    queue.

    Args:
        post: ``async post(upstream_url, body: bytes) -> int`` (the status), the proxy's own session.
        concurrency: compiles running at once per proxy (each is a prefill on the upstream).
        remember: compiled spans kept in memory before the oldest is forgotten (and compiled again).
        max_backlog: compiles waiting to run, in all.
        max_per_tenant: compiles of one key tenant queued or running (default: a quarter of the backlog).
        registry: the Prometheus registry the drop counter goes to (the proxy's; None: none).
    """

    def __init__(self, post, concurrency: int = 2, remember: int = 65536, *, max_backlog: int = 256,
                 max_per_tenant: int | None = None, registry: CollectorRegistry | None = None):
        per_tenant = max_per_tenant if max_per_tenant is not None else max(1, max_backlog // 4)
        if min(concurrency, remember, max_backlog, per_tenant) < 1:
            raise ConfigError(f"span compiles: concurrency {concurrency}, remember {remember}, max_backlog "
                              f"{max_backlog} and max_per_tenant {per_tenant} must all be >= 1")
        self._post = post
        self._concurrency = concurrency
        self._known: LRUCache[tuple[str, str, str], None] = LRUCache(remember)  # compiled spans (LRU)
        self.max_backlog, self.max_per_tenant = max_backlog, per_tenant
        self._backlog: deque[_Compile] = deque()
        self._per_tenant: Counter[str] = Counter()  # key tenant (or salt) -> its compiles queued or running
        self._workers: set[asyncio.Task] = set()
        self._running = 0
        self.compiled = 0
        self.failed = 0
        self.dropped = PromCounter("contextkit_proxy_span_compiles_dropped", "span compiles not scheduled: the "
                                   "backlog was full, or the tenant had its share of it", ("reason",),
                                   registry=registry)

    @staticmethod
    def _key(url: str, salt: str, ids) -> tuple[str, str, str]:
        # the ids' machine bytes, not their JSON: hashing is then one C call (a 1M-token request's spans
        # took ~0.3 s of the event loop as JSON)
        return url, salt, hashlib.sha256(array.array("q", ids).tobytes()).hexdigest()

    @property
    def pending(self) -> int:
        """Compiles queued or running."""
        return len(self._backlog) + self._running

    @property
    def backlog(self) -> int:
        """Compiles waiting to run."""
        return len(self._backlog)

    def pending_of(self, owner: Tenant | str) -> int:
        """Compiles of ``owner`` (a tenant: its key tenant's; a string: a salt) queued or running."""
        return self._per_tenant.get(_owner(owner), 0)

    def forget(self, url: str, salt: str, ids) -> None:
        self._known.pop(self._key(url, salt, ids), None)

    def remember(self, url: str, salt: str, ids) -> None:
        """The span is stored on ``url`` already (the connector saved it out of a request): no compile."""
        self._known[self._key(url, salt, ids)] = None

    def schedule(self, url: str, model: str | None, salt: str, spans: list[list[int]], *,
                 tenant: Tenant | None = None) -> None:
        """Compile every span in ``spans`` (token ids) this proxy has not compiled on ``url`` for ``salt``,
        within the backlog's bounds (``tenant``: whose share it takes; None: the salt's)."""
        owner = _owner(tenant if tenant is not None else salt)
        for ids in spans:
            key = self._key(url, salt, ids)
            if key in self._known:
                self._known[key]  # a read marks it just used
                continue
            if len(self._backlog) >= self.max_backlog:
                self.dropped.labels("backlog_full").inc()
                continue
            if self._per_tenant[owner] >= self.max_per_tenant:
                self.dropped.labels("tenant_share").inc()
                continue
            self._known[key] = None  # past ``remember``, the least recently named span is forgotten
            body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0, "cache_salt": salt,
                    "kv_transfer_params": SPAN_COMPILE}
            if model:
                body["model"] = model
            self._backlog.append(_Compile(url, key, owner, body))  # serialized when it runs: one span at a time
            self._per_tenant[owner] += 1
        while self._backlog and len(self._workers) < self._concurrency:
            task = asyncio.create_task(self._work())
            self._workers.add(task)

    async def _work(self) -> None:
        """Run queued compiles until the backlog is empty (one of at most ``concurrency`` workers)."""
        try:
            while self._backlog:
                job = self._backlog.popleft()
                self._running += 1
                try:
                    await self._compile(job)
                finally:
                    self._running -= 1
                    self._per_tenant[job.owner] -= 1
                    if self._per_tenant[job.owner] <= 0:
                        del self._per_tenant[job.owner]
        finally:
            # leave the set before returning, with no await in between: a compile scheduled from now on
            # starts a worker of its own instead of waiting on this one
            self._workers.discard(asyncio.current_task())

    async def _compile(self, job: _Compile) -> None:
        try:
            status = await self._post(job.url, json.dumps(job.body).encode())
        except Exception as exc:  # noqa: BLE001 - a failed compile is a later miss, compiled again
            status = f"failed: {exc}"
        if status == 200:
            self.compiled += 1
            return
        self.failed += 1
        self._known.pop(job.key, None)
        log.warning({"span_compile": job.url, "status": status})

    async def idle(self) -> None:
        """Wait for the compiles scheduled so far (benchmarks and tests)."""
        while self._workers:
            await asyncio.gather(*list(self._workers), return_exceptions=True)


@dataclass(frozen=True, slots=True)
class _Compile:
    """One queued compile: where, its remembered key, whose share it takes, and the request body."""

    url: str
    key: tuple[str, str, str]
    owner: str
    body: dict


def _owner(owner: Tenant | str) -> str:
    """The name a compile's share is charged to: a tenant's key tenant (its sub-tenants share one), or a salt."""
    return "t:" + owner.key_tenant.name if isinstance(owner, Tenant) else "s:" + owner
