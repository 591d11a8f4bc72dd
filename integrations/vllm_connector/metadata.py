"""What the connector's scheduler side tells its worker side, once per step (``ConnectorMeta``).

The two sides run in different processes and share nothing else: the scheduler (``scheduler.py``) plans
the step's loads and saves, vLLM carries this object to the worker (``worker.py``), which does them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from contextkit.integrations.vllm_connector.lookup import Piece
from contextkit.integrations.vllm_connector.saves import SaveOp


@dataclass(frozen=True, slots=True)
class RepairPlan:
    """Recompute, in the worker, part of a pic load before vLLM reads it (``repair.Repairer``).

    ``ids`` are the prompt's tokens up to where the selection may look (the loaded region, then the
    question). Candidates are the loaded tokens of re-positioned spans (``pieces``: ``(dst, n, src)`` of
    each); ``sinks`` (prompt positions) are recomputed whatever the policy, and ``count`` more are chosen
    by ``policy`` (query_attention, kv_deviation; 0 for first_k)."""

    policy: str
    count: int
    sinks: tuple[int, ...]
    pieces: tuple[tuple[int, int, int], ...]
    ids: tuple[int, ...]
    probe_layers: int
    check_layer: int
    # the calibration profile's tail gate for the budget's setting (``core.policy.Resolved``): a repair
    # that moved the keys it recomputed further than this is not written, vLLM computes the region in full
    # (``repair.TailEscalated``); None: no gate
    tail_gate: float | None = None


@dataclass(frozen=True, slots=True)
class LoadOp:
    """Load tokens ``start..end`` of request ``req_id`` from the store: ``pieces`` (contiguous from
    ``start``) into the request's cache blocks ``block_ids``."""

    req_id: str
    start: int
    end: int
    pieces: tuple[Piece, ...]
    block_ids: tuple[int, ...]
    repair: RepairPlan | None = None


@dataclass
class ConnectorMeta(KVConnectorMetadata):
    """One step's plan: loads run before the forward, saves after it."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
