"""serve's part of parallel agents over HTTP (``synthesis.handles``): a worker's answer kept under its
response id, a synthesizer's named handles read from that KV, and what each request was told."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from contextkit.core.errors import InputError
from contextkit.core.generation import SamplingParams
from contextkit.core.planner import ChatRequest
from contextkit.kit import ContextKit, KitStream
from contextkit.synthesis.handles import HandleRead, KeepLimits, KeptSpans, keep_answer
from contextkit.synthesis.splice import splice


@dataclass
class Turn:
    """One chat's part in it: its response id (the handle it is kept under), whether to keep it, the
    handles it names, and (filled on the engine thread) what was read and kept."""

    rid: str
    keep: bool = False
    handles: list[Any] | str = field(default_factory=list)  # or "auto" (synthesis.splice.AUTO)
    reads: list[HandleRead] = field(default_factory=list)
    kept: dict[str, Any] | None = None

    def extension(self) -> dict[str, Any]:
        """The response's ``contextkit`` fields for it (none for a chat that neither keeps nor names)."""
        out: dict[str, Any] = {}
        if self.handles:
            out["handles"] = [r.as_dict() for r in self.reads]
        if self.keep:
            out["kept"] = self.kept
        return out


class KeptAnswers:
    """The kept answers of one serve app, with their metrics."""

    def __init__(self, limits: KeepLimits, registry: CollectorRegistry):
        self.store = KeptSpans(limits)
        self.kept = Counter("contextkit_serve_kept", "worker answers asked to be kept, by outcome",
                            ("outcome",), registry=registry)
        self.reads = Counter("contextkit_serve_handle_reads",
                             "handles named by requests, by how they were read (kv, or why from text)",
                             ("read",), registry=registry)
        self.held = Gauge("contextkit_serve_kept_bytes", "KV bytes of kept worker answers", registry=registry)
        self.count = Gauge("contextkit_serve_kept_handles", "kept worker answers", registry=registry)
        self.evicted = Counter("contextkit_serve_kept_evicted", "kept answers dropped by the limits before their TTL",
                               registry=registry)
        self.keep_seconds = Histogram("contextkit_serve_keep_seconds",
                                      "time to keep an answer's KV, after its last token (one decode step at most "
                                      "and a copy)", registry=registry,
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))
        self._evicted_seen = 0

    def check(self, turn: Turn) -> None:
        """422 before the request is queued when it names more handles than the limit."""
        limit = self.store.limits.max_per_request
        if not isinstance(turn.handles, str) and len(turn.handles) > limit:
            raise InputError(f"{len(turn.handles)} handles named; at most {limit} per request (send the rest "
                             "as text only)", "contextkit")

    def start(self, kit: ContextKit, req: ChatRequest, params: SamplingParams, turn: Turn) -> KitStream:
        """On the engine thread: plan the chat, read its named handles, start it, and keep its answer."""
        plan = kit.plan(req)
        provided = None
        if turn.handles:
            plan, provided, turn.reads = splice(plan, turn.handles, self.store, req.tenant, spans=kit.spans)
            for r in turn.reads:
                self.reads.labels(r.read).inc()
        stream = kit.run(plan, params, compile_after=False, provided=provided)
        if turn.keep:
            stream.then(lambda: self._keep(kit, stream, turn))
        return stream

    def _keep(self, kit: ContextKit, stream: KitStream, turn: Turn) -> None:
        t0 = time.perf_counter()
        got = keep_answer(kit.spans, stream.generation, stream.plan, stream.plan.tenant)
        if isinstance(got, str):
            turn.kept = {"handle": None, "why": got}
        elif not self.store.put(stream.plan.tenant, turn.rid, *got):
            turn.kept = {"handle": None, "why": "its KV is over the kept-bytes limit"}
        else:
            turn.kept = {"handle": turn.rid, "tokens": got[0].num_tokens,
                         "read_tokens": sum(r.num_tokens for r in got[2]), "ttl_s": self.store.limits.ttl_s}
        self.kept.labels("kept" if turn.kept["handle"] else "not_kept").inc()
        self.keep_seconds.observe(time.perf_counter() - t0)
        self._gauges()

    def drop(self, tenant, handle: str) -> bool:
        dropped = self.store.drop(tenant, handle)
        self._gauges()
        return dropped

    def _gauges(self) -> None:
        s = self.store.stats()
        self.held.set(s["bytes"])
        self.count.set(s["handles"])
        self.evicted.inc(s["evicted"] - self._evicted_seen)
        self._evicted_seen = s["evicted"]
