"""The servers ``bench connector`` runs (vLLM A, restarted once, and B, with the connector on a disk tier and
Redis) and its wait for the connector's saves to reach the shared tier."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextkit.bench.harness import Tick


def wait_saved(cfg, model_dir, block: int, redis_url: str, salt: str, dtype: str, *, prompts=(), spans=(),
                timeout_s: float = 120.0) -> float:
    """Wait until the store holds every full block of ``prompts`` and every span of ``spans`` (token id
    tuples) saved under ``salt`` (saves finish on the connector's thread after each answer, in the turns
    its pacer gives); the share that arrived within ``timeout_s`` (the rest was dropped)."""
    from contextkit.core.spec import load_spec
    from contextkit.core.tenancy import derive
    from contextkit.integrations.vllm_connector.keys import (
        KVGeometry,
        block_keys,
        model_fingerprint,
        span_key,
    )
    from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig

    spec = load_spec(model_dir)
    geom = KVGeometry(model_fingerprint(model_dir), dtype, block, spec.num_layers, spec.num_kv_heads,
                      spec.head_dim)
    keys = {k.digest: k for p in prompts for k in block_keys(geom, salt, p.ids, (p.num_tokens - 1) // block)}
    keys.update((k.digest, k) for k in (span_key(geom, salt, list(ids)) for ids in spans))
    tier = LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, mac_key=derive(cfg.load_secret(), "kv-mac")))
    try:
        deadline, missing = time.monotonic() + timeout_s, dict(keys)
        while missing and time.monotonic() < deadline:
            missing = {d: k for d, k in missing.items() if not tier.contains(k)}
            if missing:
                time.sleep(0.5)
        return round(1 - len(missing) / max(1, len(keys)), 3)
    finally:
        tier.close()


@dataclass
class Servers:
    """vLLM A (restarted once) and B, and the Redis the bench started: whatever runs at the end is stopped."""

    model_dir: Path
    block: int
    logs: Path
    a: Any = None
    b: Any = None
    a_settings: Any = None
    a_port: int = 0
    services: list = field(default_factory=list)
    saving: dict = field(default_factory=dict)  # ConnectorSettings' save_* fields the run sets (--set)
    second: bool = True  # B and A's restart (--set store_rows=0: A alone)

    def server(self, name: str, settings, port: int = 0):
        from contextkit.integrations.launchers.vllm_server import (
            VLLMServer,
            VLLMServerConfig,
        )
        from contextkit.integrations.vllm_connector import vllm_args

        return VLLMServer(VLLMServerConfig(model_dir=self.model_dir, block_size=self.block, port=port,
                                           max_model_len=8192, extra_args=tuple(vllm_args(settings)),
                                           log_file=self.logs / f"bench-connector-{name}.log"))

    def start(self, cfg, work: Path, redis_url: str, tick: Tick) -> str:
        """Start Redis (unless given), then A and B (unless not ``second``) together; the Redis URL."""
        from contextkit.integrations.launchers.process import free_port
        from contextkit.integrations.launchers.services import redis_server
        from contextkit.integrations.vllm_connector import ConnectorSettings

        if not redis_url:
            self.services.append(redis_server(log_file=self.logs / "bench-connector-redis.log").start())
            redis_url = self.services[-1].url
        self.a_settings = ConnectorSettings(disk_dir=work / "a-disk", remote_url=redis_url, cache_dir=cfg.cache_dir,
                                            **self.saving)
        b_set = ConnectorSettings(remote_url=redis_url, cache_dir=cfg.cache_dir, **self.saving)
        self.a_port = free_port()
        tick("starting vLLM A and B" if self.second else "starting vLLM A")
        self.a = self.server("a", self.a_settings, self.a_port)
        self.b = self.server("b", b_set) if self.second else None
        started = [s for s in (self.a, self.b) if s is not None]
        for s in started:
            s.launch()
        for s in started:
            s.wait()
        return redis_url

    def restart_a(self) -> None:
        self.a.stop()
        self.a = self.server("a", self.a_settings, self.a_port).start()

    def stop(self) -> None:
        for s in (self.a, self.b, *self.services):
            if s is not None:
                s.stop()
