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
class LoadOp:
    """Load tokens ``start..end`` of request ``req_id`` from the store: ``pieces`` (contiguous from
    ``start``) into the request's cache blocks ``block_ids``."""

    req_id: str
    start: int
    end: int
    pieces: tuple[Piece, ...]
    block_ids: tuple[int, ...]


@dataclass
class ConnectorMeta(KVConnectorMetadata):
    """One step's plan: loads run before the forward, saves after it."""

    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)
