"""The connector's worker side: moves the tensors between vLLM's paged KV cache and the store.

vLLM runs it in the worker process (``KVConnectorRole.WORKER``; ``connector.ContextKitConnector``
delegates to it) and hands it each step's ``ConnectorMeta`` from the scheduler side. Loads are
synchronous: one batched fetch per step under one deadline (``lookup.fetch``), then one rotation and one
cache write per layer, before the forward that needs them. An entry that is gone, fails its checks or
does not match is not loaded, is counted, and its blocks are reported to vLLM, which recomputes them.
Saves copy the step's blocks out of the cache raw and go to the store on a background thread (``saves``),
which writes when vLLM is idle or, while it serves, a bounded share of the time (``pacing``: the facade
marks each step's start and end).
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import TYPE_CHECKING

import torch

from contextkit.core.errors import ConfigError
from contextkit.integrations.vllm_connector.keys import KVGeometry
from contextkit.integrations.vllm_connector.lookup import Piece, fetch
from contextkit.integrations.vllm_connector.metadata import ConnectorMeta, LoadOp
from contextkit.integrations.vllm_connector.pacing import Pacer
from contextkit.integrations.vllm_connector.paged import PagedKV, slots_of
from contextkit.integrations.vllm_connector.repair import Repairer, RepairUnsupported, TailEscalated
from contextkit.integrations.vllm_connector.saves import SaveQueue
from contextkit.integrations.vllm_connector.settings import ConnectorSettings
from contextkit.integrations.vllm_connector.stats import ConnectorStats, Counters
from contextkit.kvstore.deadline import Deadline
from contextkit.kvstore.entry import Entry

if TYPE_CHECKING:
    from contextkit.kvstore.tiered import TieredStore

log = logging.getLogger("contextkit.connector")
_KEEP_LOAD_BYTES = 256 << 20  # the largest load buffer kept for the next load (~11k tokens of SmolLM2-135M)
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class ConnectorWorker:
    """The worker-side half of ``ContextKitConnector`` (module docstring)."""

    def __init__(self, *, settings: ConnectorSettings, geometry: KVGeometry, store: TieredStore, rope: list | None,
                 repairer: Repairer | None = None):
        self.settings = settings
        self.geometry = geometry
        self.block_size = geometry.block_size
        self.store = store
        self.rope = rope  # each layer's RoPE geometry, or None: then span K cannot be re-rotated
        self.counters = Counters()
        self._caches: list[tuple[str, torch.Tensor]] = []
        self._paged: PagedKV | None = None
        self._rotator = None
        self._load_buf: torch.Tensor | None = None  # every load's K and V (_gathered)
        self._load_errors: set[int] = set()
        self._saves: SaveQueue | None = None
        self.pacer = Pacer(busy_share=settings.save_busy_share, quiet_s=settings.save_quiet_s)
        self._repairer = repairer  # recomputes pic loads that ask for it (None: such loads fall back)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def index(name: str) -> int:
            m = _LAYER_INDEX.search(name)
            if m is None:
                raise ConfigError(f"cannot tell the layer index of KV cache {name!r}")
            return int(m.group(1))

        self._caches = sorted(kv_caches.items(), key=lambda kv: index(kv[0]))
        if len(self._caches) != self.geometry.num_layers:
            raise ConfigError(f"vLLM registered {len(self._caches)} KV caches, the model has "
                              f"{self.geometry.num_layers} layers (hybrid models are not supported)")
        self._paged = PagedKV(self._caches[0][1], self.block_size)
        if (self._paged.num_heads, self._paged.head_size) != (self.geometry.num_kv_heads, self.geometry.head_size):
            raise ConfigError(f"KV cache heads/head size {self._paged.num_heads}/{self._paged.head_size} differ from "
                              f"the model's {self.geometry.num_kv_heads}/{self.geometry.head_size}")
        self._saves = SaveQueue(self.store, budget_bytes=self.settings.save_queue_bytes, counters=self.counters,
                                layout=self.geometry.layout(), pacer=self.pacer, rope=self.rope)
        self._saves.prewarm(layers=len(self._caches), paged=self._paged)
        # touch the load buffer for 2k tokens now, so that the first loads pay no page faults
        g = self.geometry
        per_token = g.num_layers * g.num_kv_heads * g.head_size  # elements of K (and of V) per token
        tokens = min(2048, _KEEP_LOAD_BYTES // (2 * per_token * self._paged.dtype.itemsize))
        self._load_buf = torch.zeros(2 * per_token * tokens, dtype=self._paged.dtype)
        if self._repairer is not None:
            try:
                self._repairer.warm()
            except Exception as exc:  # noqa: BLE001 - then each repair tries and falls back, counted
                log.warning("contextkit connector: span recompute is unavailable (%s: %s); pic requests that ask "
                            "for it are computed by vLLM", type(exc).__name__, exc)

    def start_load_kv(self, meta: object) -> None:
        if not isinstance(meta, ConnectorMeta) or not meta.loads or self._paged is None:
            return
        # the step's entries in one batched call, under one deadline for the whole step
        entries = fetch(self.store, [p for op in meta.loads for p in op.pieces],
                        deadline=Deadline(self.settings.timeout_s))
        at = 0
        for op in meta.loads:
            self._load(op, entries[at : at + len(op.pieces)])
            at += len(op.pieces)

    def _load(self, op: LoadOp, entries: list[Entry | None | Exception]) -> None:
        """Read the op's entries, then write them with one rotation and one cache write per layer (each
        torch call costs tens of microseconds inside vLLM's worker: per block and layer it added up to
        hundreds of milliseconds a request)."""
        bs = self.block_size
        ks, vs, shifts, good = [], [], [], []
        for piece, entry in zip(op.pieces, entries):
            try:
                k, v = self._read_entry(piece, entry)
            except _Unloadable as exc:
                log.warning("request %s: not loading tokens %d..%d (%s); vLLM recomputes them", op.req_id,
                            piece.dst, op.end, exc)
                self.counters.add("load_failures")
                self._load_errors.update(op.block_ids[piece.dst // bs : -(-op.end // bs)])
                break
            ks.append(k)
            vs.append(v)
            shifts.append(torch.full((piece.n,), piece.shift, dtype=torch.long))
            good.append(piece)
        if not good:
            return
        k, v = self._gathered(ks, vs)  # (layers, tokens, heads, head_size)
        delta = torch.cat(shifts)
        # the pieces are contiguous from op.start (the scheduler plans them so): one slot lookup
        slots = slots_of(list(op.block_ids), bs, good[0].dst, good[-1].dst + good[-1].n)
        assert len(slots) == delta.numel(), "load pieces must be contiguous"
        rotate = bool(delta.any())
        if op.repair is not None:  # the repair needs the whole region: a part missing leaves it all to vLLM
            if good[-1].dst + good[-1].n != op.end:
                self._load_errors.update(op.block_ids[op.start // bs : -(-op.end // bs)])
                return
            if rotate:
                for li in range(len(self._caches)):
                    self._rotate(k[li].transpose(0, 1), delta, li)
            if not self._repaired(op, k, v):
                return
            rotate = False
        for li, (_, cache) in enumerate(self._caches):
            kl, vl = k[li].transpose(0, 1), v[li].transpose(0, 1)  # (heads, tokens, head_size) views
            if rotate:
                self._rotate(kl, delta, li)  # in place
            self._paged.write(cache, slots, kl, vl)
        n = int(delta.numel())
        self.counters.add("loaded_tokens", n)
        if rotate:
            self.counters.add("span_tokens", int((delta != 0).sum()))

    def _repaired(self, op: LoadOp, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Recompute the op's selected tokens in ``k``/``v`` (``repair.py``); False when the repair raised:
        then nothing is written, the region's blocks are reported, and vLLM computes them (a full prefill
        of the span region, never wrong KV)."""
        t0 = time.perf_counter()
        try:
            if self._repairer is None:
                raise RepairUnsupported("no repairer (the model's RoPE geometry is unknown)")
            prefix = self._prefix(op) if op.start else None
            n = self._repairer.run(op.repair, start=op.start, end=op.end, prefix=prefix, k=k, v=v)
        except TailEscalated as exc:  # the tail gate: exact by design, not a fault
            log.info("request %s: tokens %d..%d computed by vLLM (%s)", op.req_id, op.start, op.end, exc)
            self.counters.add("tail_escalations")
            self._load_errors.update(op.block_ids[op.start // self.block_size : -(-op.end // self.block_size)])
            return False
        except Exception as exc:  # noqa: BLE001 - out of memory, an unsupported model, a bug: all fall back
            log.warning("request %s: repair of tokens %d..%d failed (%s: %s); vLLM computes them", op.req_id,
                        op.start, op.end, type(exc).__name__, exc)
            self.counters.add("repair_failures")
            self._load_errors.update(op.block_ids[op.start // self.block_size : -(-op.end // self.block_size)])
            return False
        self.counters.add("repairs")
        self.counters.add("repaired_tokens", n)
        self.counters.add("repair_ms", round((time.perf_counter() - t0) * 1e3))
        return True

    def _prefix(self, op: LoadOp) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the request's tokens before the load, read back from vLLM's cache:
        ``(layers, kv_heads, start, head_size)`` each."""
        slots = slots_of(list(op.block_ids), self.block_size, 0, op.start)
        ks, vs = zip(*(self._paged.read(cache, slots) for _, cache in self._caches))
        return torch.stack(ks), torch.stack(vs)

    def _gathered(self, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pieces' K and V, each ``(layers, heads, n, head_size)``, concatenated along the tokens into
        token-major ``(layers, tokens, heads, head_size)``: the order vLLM's cache op takes, so that writing a
        layer copies nothing more (2.5x less time than concatenating then transposing each layer). In memory
        every load reuses (up to ``_KEEP_LOAD_BYTES``): a fresh buffer for a long prompt's K and V (tens of
        MB) cost a page fault per 4 KiB, up to 80 ms of a load inside vLLM's worker (measured on a restart)."""
        layers, heads, _, head_size = ks[0].shape
        shape = (layers, sum(p.shape[2] for p in ks), heads, head_size)
        n = math.prod(shape)
        buf = self._load_buf
        if buf is None or buf.numel() < 2 * n or buf.dtype != ks[0].dtype:
            buf = torch.empty(max(2 * n, 2 * buf.numel() if buf is not None else 0), dtype=ks[0].dtype)
            if buf.numel() * buf.element_size() <= _KEEP_LOAD_BYTES:
                self._load_buf = buf
        k, v = buf[:n].view(shape), buf[n : 2 * n].view(shape)
        torch.cat([p.transpose(1, 2) for p in ks], dim=1, out=k)
        torch.cat([p.transpose(1, 2) for p in vs], dim=1, out=v)
        return k, v

    def _read_entry(self, piece: Piece, entry: Entry | None | Exception) -> tuple[torch.Tensor, torch.Tensor]:
        """The piece's K and V, (layers, heads, n, head_size) each, checked against what was asked."""
        if isinstance(entry, Exception):
            raise _Unloadable(f"store error: {entry}")
        if entry is None:
            raise _Unloadable("entry gone or failed its checks")
        g = self.geometry
        if entry.meta.layout != g.layout():
            raise _Unloadable(f"entry layout {entry.meta.layout!r} is not this server's")
        k, v, ids = entry.tensors.get("k"), entry.tensors.get("v"), entry.tensors.get("ids")
        want = (g.num_layers, g.num_kv_heads, piece.key.num_tokens, g.head_size)
        if k is None or v is None or ids is None or tuple(k.shape) != want or tuple(v.shape) != want:
            raise _Unloadable(f"entry shapes do not match {want}")
        if tuple(ids[piece.src : piece.src + piece.n].tolist()) != piece.ids:
            raise _Unloadable("entry token ids differ from the request's")
        sl = slice(piece.src, piece.src + piece.n)
        return k[:, :, sl], v[:, :, sl]  # views: _gathered copies them out of the entry's buffer

    def _rotate(self, k: torch.Tensor, delta: torch.Tensor, layer: int) -> torch.Tensor:
        if self.rope is None:
            raise _Unloadable("no RoPE geometry for this model")
        if self._rotator is None:
            from contextkit.kernels.rerotate import Rerotator

            self._rotator = Rerotator()
        return self._rotator(k, delta, self.rope[layer], out=k)

    def wait_for_save(self, meta: object) -> None:
        """Hand the step's saves to the save queue (after every layer ran)."""
        if self._paged is None or not isinstance(meta, ConnectorMeta) or not meta.saves:
            return
        self._saves.submit(meta.saves, caches=self._caches, paged=self._paged)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> ConnectorStats | None:
        return self.counters.take()

    def shutdown(self) -> None:
        if self._saves is not None:
            self._saves.close()


class _Unloadable(Exception):
    """An entry that must not be loaded (the reason is the message)."""
