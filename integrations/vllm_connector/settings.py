"""The connector's settings, and the ``--kv-transfer-config`` that loads it into a stock vLLM server.

vLLM hands a connector one JSON object (``--kv-transfer-config``); ours reads its part from
``kv_connector_extra_config["contextkit"]``:

    {"kv_connector": "ContextKitConnector",
     "kv_connector_module_path": "contextkit.integrations.vllm_connector",
     "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"contextkit": {"remote_url": "redis://127.0.0.1:6379", ...}}}

``kv_load_failure_policy`` must be ``recompute``: vLLM's default (``fail``) fails the request when an
entry turns out corrupt or gone between lookup and load, where we want vLLM to compute those tokens.
The deployment secret that keys every entry's MAC is read from ``<cache_dir>/secret`` (or the file named
by ``secret_file``), never passed on the command line, where ``ps`` would show it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from contextkit.core.config import DEFAULT_CACHE_DIR, KVStoreConfig, check_remote_url, remote_url_forms
from contextkit.core.errors import ConfigError
from contextkit.integrations.vllm_connector.wire import KEY

CONNECTOR_CLASS = "ContextKitConnector"
CONNECTOR_MODULE = "contextkit.integrations.vllm_connector"
EXTRA_KEY = KEY  # kv_connector_extra_config["contextkit"], as in kv_transfer_params


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Where the connector keeps KV and how long it may wait for it.

    Attributes:
        disk_dir: an LMCache disk tier (survives a restart of this server); None: none.
        disk_bytes: capacity of the disk tier.
        remote_url: ``redis://host:port`` or ``lm://host:port`` (lmcache_server), shared by servers;
            None: none. At least one of ``disk_dir`` and ``remote_url`` is required.
        timeout_s: deadline of one step's store calls, all together: a scheduler step's lookups (one batched
            call per request), a worker step's loads (one batched call); what a slower or dead store has not
            answered by then is a miss, and vLLM computes it.
        cache_dir: where the deployment secret lives (``<cache_dir>/secret``), shared with the proxy.
        secret_file: the secret's file, when it is not ``<cache_dir>/secret``.
        save_queue_bytes: bytes of saves staged or waiting for the store at most; past it the saves worth
            least (deepest into their prompts) are dropped and counted, so a slow store never holds a
            forward step nor fills the server's memory.
        save_busy_share: while vLLM serves, the share of the time the save thread may spend writing
            (``pacing``); saves are written at once when it is idle. 0: only when idle.
        save_quiet_s: how long after a step vLLM counts as idle.
        encrypt: encrypt entries at rest (AES-256-GCM under a key derived from the secret).
        max_spans: spans of one pic request looked up at most; past it the rest are computed by vLLM (and
            a warning says so), so one request cannot make the scheduler's lookup arbitrarily long.
        context_spans: save a pic request's spans the store lacked out of that request (the KV they got in
            its context, re-rotated to 0); False: only span compiles (each computed alone) store spans.
            Measured in two held-out runs, without then with (docs/benchmarks.md): whole-answer agreement of
            the default recompute 0.917 -> 0.945 and median answer KL 0.020 -> 0.015, but its p90 0.13 ->
            0.29; and no compile prefills.

    Limits on the repair (``limits``): a pic request may ask for recompute, and its repair runs inside
    vLLM's step (``start_load_kv``), so every tenant's decode waits for it. A client's choice is clamped
    to these when the request is resolved, and the report says so (``"clamped": true`` and the limits that
    applied); a repair over a limit it cannot be clamped to is shed: it loads nothing of its span region
    and vLLM computes it (a full prefill of it), counted in ``repair_sheds``. The defaults never bind on
    the built-in default policy (query_attention r=0.3, at most 512 tokens) nor on ``bench connector``;
    a calibrated profile's high ratios on long prompts can exceed the step's budget and are then shed
    (a repair of 70% of the prompt saves little over the full prefill, which vLLM chunks across steps).

        max_recompute_ratio: the largest recompute ratio a request runs (0.7: ``contextkit calibrate``'s
            largest by default); a higher one is run at this ratio.
        max_recompute_tokens: tokens one request's repair recomputes at most (sinks and chosen, 4096);
            past it the chosen ones are cut (the sinks kept); a request whose sinks alone exceed it is shed.
        max_step_recompute_tokens: a scheduler step's repairs, all together, in tokens through the whole
            model (each recomputed token, plus the selection's pass over part of the layers, weighted by its
            share of them); a request whose repair would take the step past it is shed. None (the default):
            the server's own step budget (``--max-num-batched-tokens``), so a step that repairs does at most
            about twice the forward work vLLM itself schedules in one (the repair runs before the step's
            forward, inside it).
        max_repair_bytes: the repair's own memory at most (1 GiB): its cache of the prompt up to the
            selection's end plus the copy of the request's local prefix, K and V of every layer (SmolLM2-135M
            in bf16: ~23 KB a token); a request over it is shed.
        repair_chunk_tokens: tokens recomputed per forward of the repair at most (512): the chosen tokens
            run in position order, chunk after chunk, which bounds the forward's activations.
        repair_token_cost: what one token of the repair's work costs in tokens of vLLM's own prefill; a
            repair whose work times this reaches the tokens it loads would cost more than vLLM computing
            them (first_k at a large k over short passages recomputes all of them), so it is skipped: the
            request loads nothing of its span region and vLLM computes it, counted in ``repair_skips``.
            1.0 (the default) is the bound that holds on any machine: the repair is never cheaper per token
            than vLLM's own kernels (measured 1.5x dearer in fp32 on an AVX2 EPYC, docs/benchmarks.md);
            set the measured ratio to skip more, 0 to never skip.
    """

    disk_dir: Path | None = None
    disk_bytes: int = 8 << 30
    remote_url: str | None = None
    timeout_s: float = 2.0
    cache_dir: Path = DEFAULT_CACHE_DIR
    secret_file: Path | None = None
    save_queue_bytes: int = 1 << 30
    save_busy_share: float = 0.05
    save_quiet_s: float = 0.05
    encrypt: bool = False
    max_spans: int = 256
    context_spans: bool = True
    max_recompute_ratio: float = 0.7
    max_recompute_tokens: int = 4096
    max_step_recompute_tokens: int | None = None
    max_repair_bytes: int = 1 << 30
    repair_chunk_tokens: int = 512
    repair_token_cost: float = 1.0

    def __post_init__(self) -> None:
        if self.disk_dir is None and not self.remote_url:
            raise ConfigError("the contextkit connector needs a store: set disk_dir (survives restarts) and/or "
                              f"remote_url ({remote_url_forms()}, shared by servers)")
        if self.remote_url:
            check_remote_url(self.remote_url)
        if self.timeout_s <= 0 or self.disk_bytes <= 0 or self.save_queue_bytes <= 0 or self.max_spans <= 0:
            raise ConfigError(f"timeout_s, disk_bytes, save_queue_bytes and max_spans must be positive, got "
                              f"{self.timeout_s}, {self.disk_bytes}, {self.save_queue_bytes}, {self.max_spans}")
        for name in ("disk_dir", "cache_dir", "secret_file"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value).expanduser())
        if not 0.0 <= self.save_busy_share <= 1.0 or not 0.0 <= self.save_quiet_s <= 10.0:
            raise ConfigError(f"save_busy_share must be in [0, 1] and save_quiet_s in [0, 10] seconds, got "
                              f"{self.save_busy_share}, {self.save_quiet_s}")
        self._check_repair_limits()

    def _check_repair_limits(self) -> None:
        if type(self.max_recompute_ratio) not in (int, float) or not 0.0 <= self.max_recompute_ratio <= 1.0:
            raise ConfigError(f"max_recompute_ratio must be in [0, 1], got {self.max_recompute_ratio}")
        cost = self.repair_token_cost
        if type(cost) not in (int, float) or not 0.0 <= cost <= 100.0:
            raise ConfigError(f"repair_token_cost must be a number in [0, 100] (0: never skip), got {cost!r}")
        for name in ("max_recompute_tokens", "max_step_recompute_tokens", "max_repair_bytes", "repair_chunk_tokens"):
            value = getattr(self, name)
            if value is None and name == "max_step_recompute_tokens":
                continue
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

    def store(self) -> KVStoreConfig:
        """The tiers this server keeps KV in, as every process that keeps KV describes them (``build_store``
        builds them): every ``KVStoreConfig`` setting this one has by name is passed on (a tier's setting added
        to both reaches vLLM with no change here); ``timeout_s`` bounds the remote calls; no memory tier: vLLM's
        prefix cache is this server's."""
        shared = {name: getattr(self, name) for name in KVStoreConfig.__dataclass_fields__
                  if name in self.__dataclass_fields__}
        return KVStoreConfig(**shared, remote_timeout_s=self.timeout_s)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Read ``kv_connector_extra_config["contextkit"]``; unknown keys are an error, not ignored."""
        raw = dict((extra or {}).get(EXTRA_KEY) or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown contextkit connector settings {unknown}; known: {sorted(known)}")
        return cls(**raw)

    def as_extra(self) -> dict[str, Any]:
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items() if v is not None}
        return {EXTRA_KEY: out}


def transfer_config(settings: ConnectorSettings) -> dict[str, Any]:
    """The ``--kv-transfer-config`` object that loads the contextkit connector with ``settings``."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": settings.as_extra(),
    }


def vllm_args(settings: ConnectorSettings) -> list[str]:
    """vLLM command-line arguments that load the connector (``VLLMServerConfig(extra_args=...)``)."""
    return ["--kv-transfer-config", json.dumps(transfer_config(settings))]
