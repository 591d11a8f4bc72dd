"""What the store holds of a request: the scheduler's lookups and the worker's fetches.

vLLM's scheduler asks the connector, request by request, how many tokens it can load; every waiting
request of every tenant waits behind those calls. So a step's store calls share one deadline
(``ConnectorSettings.timeout_s``, a ``kvstore.deadline.Deadline`` started by the step's first lookup),
each request's lookup is one batched call (Redis: one round trip), and a pic request looks up at most
``max_spans`` spans: what is not known in time, or past the cap, is computed by vLLM.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from contextkit.core.policy import ReuseOptions
from contextkit.integrations.vllm_connector.keys import ConnectorKey, KVGeometry, block_keys, span_key
from contextkit.integrations.vllm_connector.wire import RequestOptions
from contextkit.kvstore.deadline import Deadline
from contextkit.kvstore.entry import Entry

log = logging.getLogger("contextkit.connector")


@dataclass(frozen=True, slots=True)
class Piece:
    """Tokens ``[src, src + n)`` of a stored entry, written at request positions ``[dst, dst + n)``, with K
    re-rotated by ``shift`` positions: 0 for an exact block (stored at its own positions), the span's start
    for a span (stored at positions 0..len-1)."""

    key: ConnectorKey
    src: int
    n: int
    dst: int
    ids: tuple[int, ...]  # the request's token ids there: the entry must hold the same
    shift: int = 0


@dataclass
class RequestState:
    """Scheduler-side state of one request."""

    ids: list[int]
    opts: RequestOptions
    salt: str | None  # the salt keys are named under
    keys: list[ConnectorKey] | None = None  # exact block keys of the prompt's full blocks (lazily)
    lookup: tuple[int, int, tuple[Piece, ...], tuple] | None = None  # (computed, n, pieces, missing spans)
    load: tuple[int, int, tuple[Piece, ...]] | None = None  # allocated: (start, end, pieces)
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = -1  # exact blocks saved or known stored; -1: not scheduled yet
    span_saved: bool = False
    loaded_tokens: int = 0
    repair: ReuseOptions | None = None  # pic with recompute: the setting resolved for this request
    tail_gate: float | None = None  # policy="budget": the profile's tail gate for that setting (RepairPlan)
    report: dict = field(default_factory=dict)  # how it was resolved (policy, ratio, profile, band)
    recomputed_tokens: int = 0
    context_saved: set = field(default_factory=set)  # pic: missing spans saved out of this request


class Lookup:
    """The scheduler's lookups of one connector.

    Args:
        store: the connector's store (``contains``).
        geometry: the server's KV geometry (names the keys).
        timeout_s: the deadline of one scheduler step's lookups, all together.
        max_spans: spans of one pic request looked up at most.
        clock: the deadline's clock (tests pass their own).
    """

    def __init__(self, store, geometry: KVGeometry, *, timeout_s: float, max_spans: int,
                 clock: Callable[[], float] = time.monotonic):
        self.store = store
        self.geometry = geometry
        self.timeout_s = timeout_s
        self.max_spans = max_spans
        self.clock = clock
        self._deadline: Deadline | None = None

    def new_step(self) -> None:
        """The scheduler built a step: the next lookup starts the next step's deadline."""
        self._deadline = None

    def _step_deadline(self) -> Deadline:
        if self._deadline is None:
            self._deadline = Deadline(self.timeout_s, clock=self.clock)
        return self._deadline

    def has(self, key: ConnectorKey) -> bool:
        """Whether the store holds ``key`` (within the step's deadline; unknown: False)."""
        return bool(self.store.contains_many([key], deadline=self._step_deadline())[0])

    def block_keys(self, st: RequestState) -> list[ConnectorKey]:
        if st.keys is None:
            st.keys = block_keys(self.geometry, st.salt, st.ids, len(st.ids) // self.geometry.block_size)
        return st.keys

    def blocks(self, st: RequestState, computed: int, limit: int) -> tuple[Piece, ...]:
        """Stored exact blocks from ``computed`` on, while they are contiguous."""
        bs, keys = self.geometry.block_size, self.block_keys(st)
        first, last = computed // bs, min(len(keys), limit // bs)
        if first >= last:
            return ()
        out = []
        for i, hit in zip(range(first, last),
                          self.store.contains_many(keys[first:last], deadline=self._step_deadline())):
            if not hit:
                break
            out.append(Piece(keys[i], 0, bs, i * bs, tuple(st.ids[i * bs : (i + 1) * bs])))
        return tuple(out)

    def spans(self, st: RequestState, computed: int, limit: int) -> tuple[tuple[Piece, ...], tuple]:
        """Spans from ``computed`` on, while they are stored and contiguous; also every span not stored
        (none when the step's deadline ran out: unknown is not missing, and a missing span is compiled again)."""
        spans = st.opts.spans[:-1] if st.opts.recompute_last else st.opts.spans
        if len(spans) > self.max_spans:
            log.warning("a pic request names %d spans; the connector looks up the first %d (ConnectorSettings."
                        "max_spans) and vLLM computes the rest", len(spans), self.max_spans)
            spans = spans[: self.max_spans]
        keys = [span_key(self.geometry, st.salt, st.ids[s:e]) for s, e in spans]
        deadline = self._step_deadline()
        found = self.store.contains_many(keys, deadline=deadline)
        known = not deadline.expired
        out, missing, cursor, loading = [], [], computed, True
        for (s, e), key, stored in zip(spans, keys, found):
            if not stored and known:
                missing.append((s, e))
            if not loading or e <= cursor:
                continue
            if s > cursor or not stored or cursor >= limit:
                loading = False
                continue
            end = min(e, limit)
            out.append(Piece(key, cursor - s, end - cursor, cursor, tuple(st.ids[cursor:end]), shift=s))
            cursor = end
        return tuple(out), tuple(missing)


def fetch(store, pieces: Sequence[Piece], *, deadline: Deadline) -> list[Entry | None | Exception]:
    """The entries of a worker step's pieces (None: gone; an exception: the store failed)."""
    try:  # one batched call: LMCache's remote backend sends a batch's gets at once
        return list(store.get_many([p.key for p in pieces], deadline=deadline))
    except Exception as exc:  # noqa: BLE001 - a store failure is a miss, whatever raised it
        return [exc] * len(pieces)
