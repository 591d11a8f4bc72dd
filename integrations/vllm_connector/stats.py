"""The connector's counters, carried from the worker to vLLM's logger and exposed on its ``/metrics``.

vLLM moves connector stats between processes as a dict (``KVConnectorStats.data``) and calls our
``KVConnectorPromMetrics`` with it (vLLM's scheduler adds the scheduler side's counters to the workers':
``get_kv_connector_stats`` on both roles); the counters appear as ``contextkit_connector_<name>_total``
beside vLLM's own ``vllm:external_prefix_cache_hits``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

COUNTERS = {
    "loaded_tokens": "tokens written into vLLM's cache from the store (exact blocks and spans)",
    "span_tokens": "of those, tokens of position-free spans re-rotated to their positions",
    "load_failures": "entries that were missing, failed their MAC or checksum, or did not match (vLLM recomputed)",
    "saved_entries": "blocks and spans handed to the store",
    "saved_tokens": "tokens in those entries",
    "repairs": "pic loads whose selected tokens were recomputed in their new context before vLLM read them",
    "repaired_tokens": "tokens those repairs recomputed",
    "repair_failures": "repairs that raised: the span region was left to vLLM to compute in full",
    "tail_escalations": "repairs not written because they moved the recomputed keys past the profile's tail gate "
                        "(the request looked like its setting's tail): the span region was left to vLLM in full",
    "repair_ms": "milliseconds the worker spent repairing (divide by repairs: per request)",
    "dropped_saves": "saves dropped because the save queue was full (the least worth first) or the store refused them",
    "policy_fallbacks": "requests whose recompute setting could not be resolved (a bad value or profile): run as exact "
                        "prefix reuse",
    "wire_mismatches": "requests whose kv_transfer_params were of another protocol version (a proxy of another "
                       "release): run as exact reuse",
    "repair_clamps": "requests whose recompute was cut to the connector's limits (max_recompute_ratio, "
                     "max_recompute_tokens)",
    "repair_skips": "requests whose repair would have cost more than vLLM computing the span region it loads "
                    "(ConnectorSettings.repair_token_cost): the region was left to vLLM",
    "repair_sheds": "requests whose repair was over a limit (the step's tokens, the repair's memory): their span "
                    "region was left to vLLM to compute in full",
}


@dataclass
class ConnectorStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)


class Counters:
    """Thread-safe counts on the worker; ``take()`` hands over what accrued since the last call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = dict.fromkeys(COUNTERS, 0)
        self.total = dict.fromkeys(COUNTERS, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._pending[name] += n
            self.total[name] += n

    def take(self) -> ConnectorStats | None:
        with self._lock:
            if not any(self._pending.values()):
                return None
            out, self._pending = self._pending, dict.fromkeys(COUNTERS, 0)
        return ConnectorStats(data=out)


class ConnectorPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of ``COUNTERS``, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"contextkit_connector_{name}", documentation=doc, labelnames=labelnames)
            for name, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, n in transfer_stats_data.items():
            if name in self._counters and n:
                self._counters[name].labels(*labels).inc(n)
