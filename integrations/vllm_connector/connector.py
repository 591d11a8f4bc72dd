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

vLLM builds this class once per role, as its own connectors are built (``nixl/connector.py``): the checks
and what both roles share (settings, KV geometry, RoPE geometry, the store) are set up here, then every
call is delegated by role. The scheduler side (``scheduler.ConnectorScheduler``) looks entries up and plans
loads and saves; the worker side (``worker.ConnectorWorker``) moves the tensors (``paged.PagedKV``) and
talks to the store for the bytes; ``metadata.ConnectorMeta`` is all that passes between them, per step.
Loads are synchronous (done before the forward that needs them); saves copy the blocks out of the cache
and go to the store on a background thread through a queue bounded in bytes (``saves``), written while
vLLM is idle or a bounded share of the time while it serves (``pacing``), so neither a slow store nor
the saving itself holds a step.

Faults: a store that is down or slow answers a miss within ``timeout_s`` per step, all calls together:
one batched lookup per request, one batched fetch per worker step (``lookup``), so vLLM computes;
an entry that is gone, fails its MAC or checksum, or whose geometry or token ids do not
match is not loaded, is counted, and its blocks are reported to vLLM, which recomputes them
(``kv_load_failure_policy: recompute``). A crash mid-save leaves no entry that loads: LMCache writes
whole values (Redis SET, the disk tier's temp file + rename) and every entry carries a MAC.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from contextkit.core.errors import ConfigError
from contextkit.core.tenancy import deployment_secret, derive
from contextkit.integrations.vllm_connector.compat import SUPPORTED_VLLM, check_vllm_version
from contextkit.integrations.vllm_connector.keys import KVGeometry, model_fingerprint
from contextkit.integrations.vllm_connector.metadata import ConnectorMeta, LoadOp
from contextkit.integrations.vllm_connector.repair import Repairer
from contextkit.integrations.vllm_connector.saves import SAVE_NICE, lower_priority
from contextkit.integrations.vllm_connector.scheduler import ConnectorScheduler
from contextkit.integrations.vllm_connector.settings import ConnectorSettings
from contextkit.integrations.vllm_connector.stats import ConnectorPromMetrics, ConnectorStats
from contextkit.integrations.vllm_connector.worker import ConnectorWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["ConnectorMeta", "ContextKitConnector", "LoadOp"]

log = logging.getLogger("contextkit.connector")


class ContextKitConnector(KVConnectorBase_V1):
    """See the module docstring. Loaded by vLLM from ``--kv-transfer-config`` (``settings.transfer_config``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        check_vllm_version(vllm.__version__)  # before anything touches vLLM's internals
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
        self.rope = _rope_specs(self.model_dir)
        # the worker's store threads (LMCache's loop and writers) do the saves' I/O: they start at the save
        # thread's low CPU priority, which threads inherit on Linux (saves.SAVE_NICE)
        self.store = _open_store(self.settings, nice=SAVE_NICE if role != KVConnectorRole.SCHEDULER else 0)
        # one side per role, as vLLM's own connectors: the other stays None
        self.connector_scheduler: ConnectorScheduler | None = None
        self.connector_worker: ConnectorWorker | None = None
        refused = _repair_refused(str(vllm_config.device_config.device_type))
        if role == KVConnectorRole.SCHEDULER:
            if refused:
                log.warning("contextkit connector: %s", refused)
            sched = vllm_config.scheduler_config  # its step budget bounds the repairs' (limits.RepairLimits)
            local = _local_model_dir(mc.model, download_dir=vllm_config.load_config.download_dir,
                                     revision=mc.revision)
            self.connector_scheduler = ConnectorScheduler(settings=self.settings, geometry=self.geometry,
                                                          store=self.store, pic_loads=self.rope is not None,
                                                          step_tokens=sched.max_num_batched_tokens,
                                                          profile=_profile(local, self.geometry.dtype,
                                                                           self.settings.context_spans),
                                                          repair_refused=refused)
        else:
            repairer = (Repairer(model_dir=self.model_dir, dtype=self.geometry.dtype,
                                 chunk_tokens=self.settings.repair_chunk_tokens)
                        if self.rope and refused is None else None)
            self.connector_worker = ConnectorWorker(settings=self.settings, geometry=self.geometry,
                                                    store=self.store, rope=self.rope, repairer=repairer)
            # the worker's saves and loads go through LMCache's pools: touched now (~0.1 s per GB), the
            # first prompts' saves do not pay a page fault per 4 KiB of them (measured: ~30% more save CPU
            # for the first ~10 prompts of a fresh server), nor a restart's first loads
            for tier in self.store.tiers:
                tier.prewarm(tier.cfg.pool_bytes)
        log.info("contextkit connector (%s) on vLLM %s (supported: %s), %s: %s", role.name, vllm.__version__,
                 SUPPORTED_VLLM, self.geometry.layout(), ", ".join(t.name for t in self.store.tiers))

    # -- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)  # vLLM calls it before every step's forward
        if self.connector_worker is not None:
            self.connector_worker.pacer.step_began()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()  # ... and this after the step (after wait_for_save)
        if self.connector_worker is not None:
            self.connector_worker.pacer.step_ended()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous: done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are taken once per step, after every layer ran (wait_for_save)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        if self.has_connector_metadata():
            self.connector_worker.wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    # -- both ------------------------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> ConnectorStats | None:
        # each role's own counters: vLLM's scheduler adds its side's to what the workers sent
        if self.connector_worker is not None:
            return self.connector_worker.get_kv_connector_stats()
        return None if self.connector_scheduler is None else self.connector_scheduler.counters.take()

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
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        self.store.close()


# -- set-up shared by both roles ------------------------------------------------------------------------
def _open_store(s: ConnectorSettings, *, nice: int = 0):
    """The connector's tiers; with ``nice``, opened on a thread at that nice value, so that the threads
    LMCache starts for them inherit it (``saves.lower_priority``)."""
    if not nice:
        return _tiers(s)
    with ThreadPoolExecutor(1, thread_name_prefix="contextkit-connector-open-store", initializer=lower_priority,
                            initargs=(nice,)) as pool:
        return pool.submit(_tiers, s).result()


def _tiers(s: ConnectorSettings):
    """The connector's tiers, built as every process that keeps KV builds them (``kvstore.tiered.build_store``):
    disk and/or remote, no memory tier (vLLM's prefix cache is this server's memory tier), each call within
    the step's deadline."""
    from contextkit.kvstore.tiered import build_store

    secret = deployment_secret(s.cache_dir, path=s.secret_file)
    return build_store(s.store(), derive(secret, "kv-mac"), derive(secret, "kv-enc") if s.encrypt else None,
                       memory=False, disk_timeout_s=s.timeout_s)


def _rope_specs(model_dir: Path):
    """Each layer's RoPE geometry (to re-rotate span K), or None when the model family is unknown to us:
    then pic requests load nothing (logged once) and are computed in full."""
    try:
        from contextkit.core.spec import load_spec

        spec = load_spec(model_dir)
        return [layer.rope for layer in spec.layers]
    except Exception as exc:  # noqa: BLE001 - any reason means the same: no re-rotation here
        log.warning("contextkit connector: no RoPE geometry for %s (%s); position-independent loads are off",
                    model_dir, exc)
        return None


def _repair_refused(device: str) -> str | None:
    """Why a server computing on ``device`` (vLLM's device type) cannot repair span KV (None when it can).

    The repair runs contextkit's built-in engine, which runs on CPU. On a server whose model runs on an
    accelerator it would hold a second copy of the weights in host memory and recompute on the CPU, far
    slower than the prefill it replaces: recompute requests are then served as a full prefill of their
    span region (reported as policy "full" with this reason); ``policy: none`` still loads span KV.
    """
    if device.split(":")[0] == "cpu":
        return None
    return (f"the repair runs contextkit's built-in engine on CPU and this server computes on {device}: "
            "requests asking for recompute get a full prefill of their span region (policy none still loads "
            "span KV without recompute)")


def _local_model_dir(model: str, *, download_dir: str | None = None, revision: str | None = None) -> Path | None:
    """vLLM's ``--model`` as a directory on this machine, as vLLM itself reads it: an existing directory, else
    a Hugging Face hub id's snapshot in the local cache (vLLM's ``--download-dir`` when given, at its
    ``--revision``); None when neither (nothing here downloads)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from contextkit.core.models import hf_cached_dir

    return hf_cached_dir(model, cache_dir=download_dir, revision=revision)


def _profile(model_dir: Path | None, dtype: str, context_spans: bool = True):
    """The model's calibration profile for ``dtype`` (``contextkit calibrate``), which resolves a repaired
    request's policy="budget"; None (the built-in default) when there is none or it does not fit. A directory
    without weights files has no trusted digest (``core.models.weights_digest``), so no profile fits it.
    With ``context_spans`` (the default) most spans load as KV saved in their first request's context: the
    profile calibrated on that source (``calibrate --set kv_source=context``) is the one that measured them.
    Without one, the profile of spans compiled alone stands in, less its first_k series (it repairs the
    starts of spans compiled alone: on Qwen2.5-0.5B bf16 through vLLM it ran 1.44x prefix caching at tf 0.918
    where the query_attention setting ran 1.77x at 0.914; docs/benchmarks.md, "first_k through vLLM")."""
    if model_dir is None:
        log.warning("contextkit connector: the model is neither a directory nor in the local Hugging Face cache; "
                    "no calibration profile (recompute policy 'budget' runs the built-in default)")
        return None
    try:
        from contextkit.core.models import weights_digest
        from contextkit.spans.calibration import find_profile

        digest = weights_digest(model_dir)
        if context_spans and (own := find_profile(model_dir, model_digest=digest, dtype=dtype, kv_source="context")):
            return own
        found = find_profile(model_dir, model_digest=digest, dtype=dtype)
        return found.without_first_k() if found is not None and context_spans else found
    except Exception as exc:  # noqa: BLE001 - no profile means the built-in default, said once
        log.warning("contextkit connector: no calibration profile for %s (%s)", model_dir, exc)
        return None
