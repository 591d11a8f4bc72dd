"""The proxy's settings: flags, then ``CONTEXTKIT_PROXY_*`` environment variables, then a JSON file."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, JsonConfigSettingsSource, SettingsConfigDict


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
    max_body_bytes: int = 8 << 20  # 413 past it; a 1M-token context is ~4 MiB of text, ~7 MiB as token ids (serve's too)
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
    # CacheBlend, integrations/vllm_connector/cacheblend.py: {"policy": "kv_deviation"}, prompts joined by its separator),
    # "none": no opt-in, prompts only
    kv_connector: Literal["none", "contextkit", "cacheblend"] = "none"
    cacheblend_separator: str = " # # "  # LMCache's blend_special_str on the upstreams (CacheBlendConfig)
    span_compiles: int = Field(2, ge=1)  # span compiles running at once (each a prefill on an upstream)


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
