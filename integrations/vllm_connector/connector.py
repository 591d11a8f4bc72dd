"""``ContextKitConnector``: a vLLM V1 KV connector backed by contextkit's kvstore (LMCache's tiers).

What it does for a stock vLLM server (``settings.vllm_args`` loads it):
- **exact reuse**: every full block of a prompt that vLLM computes is saved under a key chained from a
  seeded root that names the model, the KV geometry and the request's ``cache_salt`` (``keys``); a
  later request, after a restart or on another server sharing the remote tier, loads the longest run of
  stored blocks after its local prefix-cache hit instead of computing them;
- **position-independent spans** (opt-in, ``kv_transfer_params.contextkit.mode == "pic"``): the prompt's
  spans (documents, set by the proxy) are loaded from KV each span got when it was computed alone at
  position 0 (``mode == "span"``), with K re-rotated to the span's place. vLLM computes what follows. This
  is reuse without recompute (Block-Attention without fine-tuning); its fidelity is measured in
  ``contextkit bench connector``. A pic request carries its own ``cache_salt`` (the proxy derives it),
  so the approximate blocks it leaves in vLLM's prefix cache are never an exact-prefix hit for a
  request without the same opt-in (DESIGN.md; vLLM RFC #44223), and it saves nothing.

Both roles run this class: the scheduler side looks entries up (``contains``) and plans loads and saves;
the worker side moves the tensors (``paged.PagedKV``) and talks to the store for the bytes. Loads are
synchronous (done before the forward that needs them); saves copy the tokens out of the cache and go to
the store on a background thread through a queue bounded in bytes (``saves``), so a slow store never
holds a step.

Faults: a store that is down or slow answers a miss within ``timeout_s`` per step, all calls together:
one batched lookup per request, one batched fetch per worker step (``lookup``), so vLLM computes; an entry that is gone, fails its MAC or checksum, or whose geometry or token ids do not
match is not loaded, is counted, and its blocks are reported to vLLM, which recomputes them
(``kv_load_failure_policy: recompute``). A crash mid-save leaves no entry that loads: LMCache writes
whole values (Redis SET, the disk tier's temp file + rename) and every entry carries a MAC.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from contextkit.core.errors import ConfigError
from contextkit.core.tenancy import deployment_secret, derive
from contextkit.integrations.vllm_connector.keys import KVGeometry, model_fingerprint, span_key
from contextkit.integrations.vllm_connector.lookup import Lookup, Piece, RequestState, fetch
from contextkit.integrations.vllm_connector.paged import PagedKV, slots_of
from contextkit.integrations.vllm_connector.saves import SaveOp, SaveQueue
from contextkit.integrations.vllm_connector.settings import ConnectorSettings, RequestOptions
from contextkit.integrations.vllm_connector.stats import ConnectorPromMetrics, ConnectorStats, Counters
from contextkit.kvstore.deadline import Deadline
from contextkit.kvstore.entry import Entry

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("contextkit.connector")
_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")
# -- what the scheduler tells the worker -----------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LoadOp:
    req_id: str
    start: int
    end: int
    pieces: tuple[Piece, ...]
    block_ids: tuple[int, ...]


@dataclass
class ConnectorMeta(KVConnectorMetadata):
    loads: list[LoadOp] = field(default_factory=list)
    saves: list[SaveOp] = field(default_factory=list)


class ContextKitConnector(KVConnectorBase_V1):
    """See the module docstring. Loaded by vLLM from ``--kv-transfer-config`` (``settings.transfer_config``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            raise ConfigError('the contextkit connector needs "kv_load_failure_policy": "recompute" in '
                              "--kv-transfer-config (settings.transfer_config sets it): with vLLM's default a "
                              "corrupt or vanished entry fails the request instead of being recomputed")
        par, mc = vllm_config.parallel_config, vllm_config.model_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise ConfigError("the contextkit connector supports tensor and pipeline parallel size 1 "
                              "(each rank would need its own keys)")
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None):
            raise ConfigError(f"the contextkit connector stores the model's KV dtype; kv_cache_dtype={cache_dtype!r} "
                              "is not supported")
        self.block_size = vllm_config.cache_config.block_size
        self.model_dir = Path(mc.model)
        self.geometry = KVGeometry(model_fingerprint(mc.model), str(mc.dtype).removeprefix("torch."),
                                   self.block_size, mc.get_num_layers(par), mc.get_num_kv_heads(par),
                                   mc.get_head_size())
        self.rope = self._rope_specs()
        self.store = self._open_store()
        self.counters = Counters()
        self.lookup = Lookup(self.store, self.geometry, timeout_s=self.settings.timeout_s,
                             max_spans=self.settings.max_spans)
        self._requests: dict[str, RequestState] = {}
        # worker side
        self._caches: list[tuple[str, torch.Tensor]] = []
        self._paged: PagedKV | None = None
        self._rotator = None
        self._load_errors: set[int] = set()
        self._saves: SaveQueue | None = None
        log.info("contextkit connector (%s) on %s: %s", role.name, self.geometry.layout(),
                 ", ".join(t.name for t in self.store.tiers))

    # -- set-up ----------------------------------------------------------------------------------------
    def _open_store(self):
        from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
        from contextkit.kvstore.tiered import TieredStore

        s = self.settings
        secret = deployment_secret(s.cache_dir, path=s.secret_file)
        mac_key, enc_key = derive(secret, "kv-mac"), (derive(secret, "kv-enc") if s.encrypt else None)
        tiers = []
        if s.disk_dir is not None:
            tiers.append(LMCacheTier(LMCacheTierConfig("disk", max_bytes=s.disk_bytes, disk_dir=s.disk_dir,
                                                         timeout_s=s.timeout_s, mac_key=mac_key, enc_key=enc_key)))
        if s.remote_url:
            tiers.append(LMCacheTier(LMCacheTierConfig("remote", remote_url=s.remote_url, timeout_s=s.timeout_s,
                                                         mac_key=mac_key, enc_key=enc_key)))
        return TieredStore(tiers)

    def _rope_specs(self):
        """Each layer's RoPE geometry (to re-rotate span K), or None when the model family is unknown to us:
        then pic requests load nothing (logged once) and are computed in full."""
        try:
            from contextkit.core.spec import load_spec

            spec = load_spec(self.model_dir)
            return [layer.rope for layer in spec.layers]
        except Exception as exc:  # noqa: BLE001 - any reason means the same: no re-rotation here
            log.warning("contextkit connector: no RoPE geometry for %s (%s); position-independent loads are off",
                        self.model_dir, exc)
            return None

    # -- scheduler side --------------------------------------------------------------------------------
    def _state(self, request: Request) -> RequestState:
        st = self._requests.get(request.request_id)
        if st is None:
            ids = list(request.prompt_token_ids or [])
            try:
                opts = RequestOptions.of(request.kv_transfer_params, len(ids))
                salt = opts.namespace(request.cache_salt)  # never a salt the client chose (settings)
            except ConfigError as exc:  # the request runs, with exact reuse under its own cache_salt
                log.warning("request %s: %s; using exact reuse", request.request_id, exc)
                opts, salt = RequestOptions(), request.cache_salt
            st = self._requests[request.request_id] = RequestState(ids, opts, salt)
        return st

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st.lookup is not None and st.lookup[0] == num_computed_tokens:
            return st.lookup[1], False
        limit = len(st.ids) - 1  # vLLM computes at least the last prompt token
        missing: tuple = ()
        if st.opts.mode == "off":
            pieces: tuple[Piece, ...] = ()
        elif st.opts.mode == "pic":
            # no RoPE geometry: pic requests load nothing (logged once at start) and are computed in full
            pieces, missing = self.lookup.spans(st, num_computed_tokens, limit) if self.rope is not None else ((), ())
        else:
            pieces = self.lookup.blocks(st, num_computed_tokens, limit)
        n = sum(p.n for p in pieces)
        st.lookup = (num_computed_tokens, n, pieces, missing)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._requests.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.lookup is None:
            return
        computed, n, pieces, _ = st.lookup
        kept, total = [], 0
        for p in pieces:  # vLLM may take fewer tokens than offered
            if total >= num_external_tokens:
                break
            take = min(p.n, num_external_tokens - total)
            kept.append(p if take == p.n else Piece(p.key, p.src, take, p.dst, p.ids[:take], p.shift))
            total += take
        st.load = (computed, computed + total, tuple(kept))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ConnectorMeta()
        self.lookup.new_step()  # this step's lookups are done: the next ones get a deadline of their own
        for new in scheduler_output.scheduled_new_reqs:
            st = self._requests.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            if st.saved_blocks < 0:  # first scheduled: blocks before here were hits (local or loaded)
                st.saved_blocks = new.num_computed_tokens // self.block_size
            if st.load is not None:
                start, end, pieces = st.load
                meta.loads.append(LoadOp(new.req_id, start, end, pieces, tuple(st.block_ids)))
                st.loaded_tokens += end - start
                st.load = None
            done = new.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            self._plan_saves(st, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._requests.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_saves(st, done, meta)
        return meta

    def _plan_saves(self, st: RequestState, done: int, meta: ConnectorMeta) -> None:
        """Saves of what this step completes: exact blocks (not for pic: its KV is approximate), and for a
        span compile the whole prompt once it is computed."""
        if st.opts.mode in ("pic", "off") or st.saved_blocks < 0:
            return
        bs, prompt = self.block_size, len(st.ids)
        full = min(done, prompt) // bs
        if full > st.saved_blocks:
            keys = self.lookup.block_keys(st)
            for b in range(st.saved_blocks, full):
                meta.saves.append(SaveOp(keys[b], b * bs, (b + 1) * bs, tuple(st.ids[b * bs : (b + 1) * bs]),
                                         tuple(st.block_ids)))
            st.saved_blocks = full
        if st.opts.mode == "span" and not st.span_saved and done >= prompt:
            meta.saves.append(SaveOp(span_key(self.geometry, st.salt, st.ids), 0, prompt, tuple(st.ids),
                                     tuple(st.block_ids)))
            st.span_saved = True

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        st = self._requests.pop(request.request_id, None)
        if st is None:
            return False, None
        out: dict[str, Any] = {"loaded_tokens": st.loaded_tokens, "mode": st.opts.mode}
        if st.lookup is not None and st.lookup[3]:
            out["missing_spans"] = [list(m) for m in st.lookup[3]]
        return False, {"contextkit": out}

    # -- worker side -----------------------------------------------------------------------------------
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
                                layout=self.geometry.layout())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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
        k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)  # (layers, heads, tokens, head_size)
        delta = torch.cat(shifts)
        # the pieces are contiguous from op.start (the scheduler plans them so): one slot lookup
        slots = slots_of(list(op.block_ids), bs, good[0].dst, good[-1].dst + good[-1].n)
        assert len(slots) == delta.numel(), "load pieces must be contiguous"
        rotate = bool(delta.any())
        for li, (_, cache) in enumerate(self._caches):
            kl = self._rotate(k[li], delta, li) if rotate else k[li]
            self._paged.write(cache, slots, kl, v[li])
        n = int(delta.numel())
        self.counters.add("loaded_tokens", n)
        if rotate:
            self.counters.add("span_tokens", int((delta != 0).sum()))

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
        return k[:, :, sl], v[:, :, sl]  # torch.cat copies them out of the entry's buffer

    def _rotate(self, k: torch.Tensor, delta: torch.Tensor, layer: int) -> torch.Tensor:
        if self.rope is None:
            raise _Unloadable("no RoPE geometry for this model")
        if self._rotator is None:
            from contextkit.kernels.rerotate import Rerotator

            self._rotator = Rerotator()
        return self._rotator(k, delta, self.rope[layer], out=k)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are taken once per step, after every layer ran (wait_for_save)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata() or self._paged is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, ConnectorMeta):
            return
        if not meta.saves:
            return
        self._saves.submit(meta.saves, caches=self._caches, paged=self._paged)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_kv_connector_stats(self) -> ConnectorStats | None:
        return self.counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> ConnectorStats:
        return ConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return ConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def shutdown(self) -> None:
        if self._saves is not None:
            self._saves.close()
        self.store.close()


class _Unloadable(Exception):
    """An entry that must not be loaded (the reason is the message)."""
