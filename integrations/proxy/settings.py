"""The proxy's settings: flags, then ``CONTEXTKIT_PROXY_*`` environment variables, then a JSON file."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, JsonConfigSettingsSource, SettingsConfigDict

from contextkit.integrations.proxy.reuse_paths import PATHS


class ProxySettings(BaseSettings):
    """Proxy configuration from flags, ``CONTEXTKIT_PROXY_*`` environment variables or a JSON/env file."""

    model_config = SettingsConfigDict(env_prefix="CONTEXTKIT_PROXY_", extra="forbid", frozen=True)

    upstreams: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    timeout_s: float = 120.0  # an upstream slower than this (to first byte, or between chunks) gets 504
    connect_timeout_s: float = 5.0
    block_size: int = 32  # the upstream's KV block size (vLLM: 16 on GPU, 32 on CPU)
    model: str = "smollm2-135m-instruct"  # tokenizer used to render documents; must be the upstream's
    cache_dir: Path = Path("~/.cache/contextkit")
    health_interval_s: float = 5.0
    # 413 past it; a 1M-token context is ~4 MiB of text, ~7 MiB as token ids (serve's too)
    max_body_bytes: int = 8 << 20
    # JSON values in a body at most, counted as its commas before it is parsed (413 past it): parsing holds
    # the interpreter (~0.3 s for the 1M token ids 8 MiB holds), every relayed stream waiting. None: one
    # context of token ids (the largest upstream's max_model_len, else 262,144) + 65,536 for the rest
    max_json_values: int | None = Field(None, ge=1024)
    max_n: int = 16  # choices per request (``n``); vLLM takes thousands, each one decoding on the shared server
    graceful_shutdown_s: float = 30.0
    # tenancy (contextkit.core.tenancy): keys -> tenants; none = open, loopback only
    api_keys: dict[str, str] = {}  # {"<key>": "<tenant>"}; env CONTEXTKIT_PROXY_API_KEYS='{"...": "..."}'
    api_keys_file: Path | None = None  # a JSON file of the same shape
    allow_client_tenant: bool = False  # let a key choose sub-tenants of its own in the request body
    secret: str | None = None  # derives cache salts; default: a file under cache_dir, made once
    secret_file: Path | None = None
    upstream_api_key: str | None = None  # sent to every upstream (vLLM started with --api-key)
    # /metrics names upstreams and every tenant's traffic: with a key it takes `Bearer <metrics_key>`;
    # without one, a proxy with API keys answers it to loopback clients only
    metrics_key: str | None = Field(None, min_length=16)
    # requests per second per tenant, checked before the body is read (429 past it); 0: no limit, as vLLM
    rate_per_s: float = Field(0.0, ge=0)
    rate_burst: int = Field(0, ge=0)  # requests a quiet tenant may send at once; 0: twice the rate
    # the KV connector the upstreams run, which documents requests may opt in to (contextkit.reuse):
    # "contextkit" (integrations/vllm_connector: span reuse, {"policy": "none"}), "cacheblend" (LMCache's
    # CacheBlend, integrations/vllm_connector/cacheblend.py: {"policy": "kv_deviation"}, prompts joined by
    # its separator), "none": no opt-in, prompts only
    kv_connector: str = "none"  # one of reuse_paths.PATHS (checked below)
    cacheblend_separator: str = " # # "  # LMCache's blend_special_str on the upstreams (CacheBlendConfig)
    span_compiles: int = Field(2, ge=1)  # span compiles running at once (each a prefill on an upstream)
    # routing by what each upstream's prefix cache holds (integrations/proxy/routing.py). One entry per
    # --upstream, in the same order: where that vLLM publishes its KV events (--kv-events-config), as
    # "tcp://HOST:PUB_PORT" or "tcp://HOST:PUB_PORT,tcp://HOST:REPLAY_PORT" (ipc:// too); "" or "none": it
    # does not publish (routed by the proxy's own model of its cache). Empty list: no upstream publishes.
    upstream_events: list[str] = []
    events_stale_s: float = Field(10.0, gt=0)  # sent new blocks, no event for this long: the index is stale
    index_blocks: int = Field(200_000, ge=1)  # blocks remembered per upstream (~240 bytes each); oldest go first
    # an upstream more than this many requests in flight above the least loaded one no longer attracts
    # requests by what it caches (they go to the least loaded): a hot prefix must not pile up on one server
    route_slack: int = Field(4, ge=0)
    # below the slack, what a request in flight costs against cached blocks, in prompts' worth of blocks
    # (routing.Router.pick): 0 = the deepest cache always wins; 1 = a queued request costs a whole prefill
    route_load_weight: float = Field(0.5, ge=0)
    # ordering a documents request by the fleet's KV events (ordering/event_order.py): candidate documents scored at
    # most, and the search's deadline; past either the deepest order found so far competes with the Weaver's
    event_order_scores: int = Field(50_000, ge=0)
    event_order_deadline_ms: float = Field(250.0, ge=0)
    session_affinity: bool = True  # a conversation without cache hits anywhere stays on one upstream (by its key)

    @field_validator("kv_connector")
    @classmethod
    def _known_connector(cls, kind: str) -> str:
        if kind not in PATHS:
            raise ValueError(f"kv_connector must be one of {', '.join(PATHS)}, got {kind!r}")
        return kind

    @model_validator(mode="after")
    def _events_match_upstreams(self) -> ProxySettings:
        if self.upstream_events and len(self.upstream_events) != len(self.upstreams):
            raise ValueError(f"upstream_events has {len(self.upstream_events)} entries for {len(self.upstreams)} "
                             "upstreams; give one per --upstream, in the same order (\"none\" for one that does "
                             "not publish)")
        for entry in self.upstream_events:
            for endpoint in filter(None, event_endpoints(entry) or ()):
                if not endpoint.startswith(("tcp://", "ipc://")):
                    raise ValueError(f"upstream_events entry {entry!r}: an endpoint must start with tcp:// or "
                                     "ipc:// (vLLM's --kv-events-config endpoint, as this host reaches it)")
        return self


def event_endpoints(entry: str) -> tuple[str, str | None] | None:
    """An ``upstream_events`` entry as (publisher, replay or None); None: the upstream does not publish."""
    parts = [p.strip() for p in entry.split(",") if p.strip()]
    if not parts or parts == ["none"]:
        return None
    if len(parts) > 2:
        raise ValueError(f"upstream_events entry {entry!r}: give a publisher endpoint and at most one replay "
                         "endpoint, separated by a comma")
    return parts[0], (parts[1] if len(parts) == 2 else None)


def load_settings(file: Path | None = None, **flags) -> ProxySettings:
    """Settings from flags, then ``CONTEXTKIT_PROXY_*`` environment variables, then a JSON file, then defaults."""

    class _Settings(ProxySettings):
        # pydantic-settings reads the JSON file named in model_config, so a subclass per file is how a
        # path chosen at run time reaches it
        model_config = SettingsConfigDict(**{**ProxySettings.model_config, "json_file": file})

        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                       file_secret_settings):
            return (init_settings, env_settings, JsonConfigSettingsSource(settings_cls))

    return _Settings(**flags)
