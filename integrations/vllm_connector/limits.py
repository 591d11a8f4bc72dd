"""The operator's limits on the repair inside vLLM: what one request, and one scheduler step, may recompute.

A pic request's recompute setting comes from its ``kv_transfer_params`` (the proxy maps the client's
``contextkit.reuse`` onto it, and clients can reach vLLM directly), and the worker runs the repair
synchronously in ``start_load_kv``, inside vLLM's step: every tenant's decode waits for it. So the
scheduler side holds each request to ``ConnectorSettings``' limits when it resolves the setting
(``RepairLimits.clamp``: the ratio) and when it plans the load (``RepairLimits.fit``: the tokens recomputed,
the step's forward work, the repair's memory). A request over a limit it cannot be clamped to is shed: it
loads nothing of its span region and vLLM computes it (a full prefill of it: exact, only slower for it).

Work is counted in tokens through the whole model: each recomputed token (sinks and chosen), plus the
selection's pass over part of the layers (query_attention's probe over the question, ``probe_layers`` of
them; kv_deviation's pass over the context through ``check_layer``), weighted by its share of the layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contextkit.core.policy import ReuseOptions, clamp, planned, sinks

if TYPE_CHECKING:
    from contextkit.integrations.vllm_connector.keys import KVGeometry
    from contextkit.integrations.vllm_connector.settings import ConnectorSettings

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, slots=True)
class RepairNeed:
    """What one load's repair costs: ``sinks`` and ``count`` as the worker will recompute them."""

    sinks: tuple[int, ...]
    count: int
    moved: tuple[tuple[int, int, int], ...]  # (dst, n, src) of the loaded pieces that moved
    work: int  # tokens' worth of forward work through the whole model
    bytes: int  # the repair's cache (the prompt to the probe's end) plus the copy of the local prefix
    clamped: bool  # count was cut to the per-request limit

    @property
    def tokens(self) -> int:
        return len(self.sinks) + self.count


class RepairLimits:
    """``ConnectorSettings``' repair limits, and this scheduler step's work so far (``commit``, ``new_step``).

    ``step_tokens``: the server's step budget (vLLM's ``max_num_batched_tokens``), the per-step limit when the
    settings leave ``max_step_recompute_tokens`` unset."""

    def __init__(self, *, settings: ConnectorSettings, geometry: KVGeometry, step_tokens: int):
        self.max_ratio = settings.max_recompute_ratio
        self.max_tokens = settings.max_recompute_tokens
        self.max_step_work = settings.max_step_recompute_tokens or step_tokens
        self.max_bytes = settings.max_repair_bytes
        self.token_cost = settings.repair_token_cost
        self.layers = geometry.num_layers
        # per token of the repair's cache: K and V of every layer, plus its position and segment (int64)
        itemsize = _ITEMSIZE.get(geometry.dtype, 4)
        self.token_bytes = 2 * geometry.num_layers * geometry.num_kv_heads * geometry.head_size * itemsize + 16
        self.step_work = 0

    def clamp(self, r: ReuseOptions) -> tuple[ReuseOptions, dict[str, float]]:
        """``r`` within the ratio limit, and which limits applied (``core.policy.clamp``)."""
        return clamp(r, max_ratio=self.max_ratio)

    def need(self, r: ReuseOptions, *, start: int, end: int, prompt: int, pieces, probe_end: int | None = None
             ) -> RepairNeed:
        """The repair of a load of ``pieces`` (``start..end`` of a ``prompt``-token prompt) under ``r``, its
        count cut to the per-request limit (the sinks first: they are what a moved span needs most);
        ``probe_end``: where the selection's view of the question ends (None: the prompt's end)."""
        moved = tuple((p.dst, p.n, p.src) for p in pieces if p.shift)  # spans at position 0 are exact
        sink = tuple(sinks(moved, r.first_k))
        cand = sum(n for _, n, _ in moved)
        want = planned(policy=r.policy, ratio=r.ratio, max_recompute=r.max_recompute, candidates=cand,
                       sinks=len(sink))
        count = max(0, min(want, self.max_tokens - len(sink)))
        probe_end = prompt if probe_end is None else max(end + 1, min(probe_end, prompt))
        work = len(sink) + count
        if count:  # the selection runs only when it has something to choose
            if r.policy == "query_attention":
                depth = min(r.probe_layers or self.layers, self.layers)
                work += math.ceil((probe_end - end) * depth / self.layers)
            elif r.policy == "kv_deviation":
                work += math.ceil(end * (min(r.check_layer, self.layers - 1) + 1) / self.layers)
        return RepairNeed(sink, count, moved, work, self.token_bytes * (probe_end + start), count < want)

    def not_worth(self, need: RepairNeed, loaded: int) -> str | None:
        """Why the repair of a ``loaded``-token load would cost more than vLLM computing those tokens (its
        work, in vLLM prefill tokens at ``repair_token_cost`` each, reaches them); None: it pays."""
        if self.token_cost and loaded and need.work * self.token_cost >= loaded:
            return (f"its repair is {need.work} tokens of work for the {loaded} tokens it loads (repair_token_cost "
                    f"{self.token_cost:g}): vLLM computes them for less")
        return None

    def refusal(self, need: RepairNeed) -> str | None:
        """Why this repair must be shed now (None: it fits this step). No request data in the text."""
        if len(need.sinks) > self.max_tokens:
            return f"its span sinks alone exceed max_recompute_tokens ({self.max_tokens})"
        if need.bytes > self.max_bytes:
            return f"its repair needs {need.bytes} bytes, over max_repair_bytes ({self.max_bytes})"
        if self.step_work + need.work > self.max_step_work:
            return f"the step's repairs would exceed max_step_recompute_tokens ({self.max_step_work})"
        return None

    def commit(self, need: RepairNeed) -> None:
        self.step_work += need.work

    def new_step(self) -> None:
        self.step_work = 0
