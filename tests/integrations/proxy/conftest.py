"""The proxy's tests' second vLLM server, started once for them all (each start is ~35-45 s of the suite)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class SecondServer:
    url: str
    events: str  # "publisher,replay"
    key: str  # its --api-key: a client without it gets 401
    server: Any  # the VLLMServer, which a test may restart (same port, same event endpoints)
    blocks: int  # its KV cache, in blocks of 32 tokens
    max_model_len: int

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="package")
def second_vllm(smol_dir, tmp_path_factory) -> SecondServer:
    """A second real vLLM server beside the shared one: the fleet's (a small KV cache of 64 blocks, so
    evictions happen; its KV events on ipc sockets) and the upstream-key tests' (started with --api-key)."""
    from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig, ipc_events, kv_events_args

    # max_len: 2,016 tokens (63 blocks; vLLM keeps one block of the 64 back), so bench fleet's agent turns fit
    blocks, max_len, key = 64, 2016, "upstream-key-1"
    events = ipc_events(tmp_path_factory.mktemp("second-events"))
    config = VLLMServerConfig(model_dir=smol_dir, max_model_len=max_len, kv_cache_gib=1,
                              extra_args=(*kv_events_args(*events), "--num-gpu-blocks-override", str(blocks),
                                          "--api-key", key),
                              log_file=tmp_path_factory.mktemp("second-log") / "vllm.log")
    with VLLMServer(config) as server:
        yield SecondServer(server.url, ",".join(events), key, server, blocks, max_len)
