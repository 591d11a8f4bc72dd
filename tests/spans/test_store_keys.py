"""The span store as the kit builds it (``build_store`` with keys derived from the deployment's secret) on
the real Redis (``CONTEXTKIT_REDIS_URL``): servers sharing a secret share spans; another secret names
every span otherwise (issue #26, point 9: stored names are keyed, not computable from a guessed document)."""

from __future__ import annotations

import threading

import pytest
import torch

from contextkit.core.config import KVStoreConfig
from contextkit.core.tenancy import derive
from contextkit.kernels.rope import RopeSpec
from contextkit.kvstore.tiered import build_store
from contextkit.spans.key import ModelIdentity, span_key
from contextkit.spans.store import CompiledSpan, KVSpanStore

pytestmark = pytest.mark.slow


def _store(redis_url: str, secret: bytes) -> KVSpanStore:
    cfg = KVStoreConfig(remote_url=redis_url, encrypt=True, remote_timeout_s=30)  # a busy machine is no miss
    return KVSpanStore(build_store(cfg, derive(secret, "kv-mac"), derive(secret, "kv-enc")))  # as kit.py does


def _close(*stores: KVSpanStore) -> None:
    for s in stores:
        done = threading.Event()
        threading.Thread(target=lambda s=s: (s.kv.close(), done.set()), daemon=True).start()
        assert done.wait(30), "a store did not close"


def test_spans_are_shared_under_one_secret_and_named_otherwise_under_another(redis_url):
    identity = ModelIdentity("a" * 64, "tok", "float32", (RopeSpec(64, 10000.0),))
    ids = tuple(range(500, 540))
    key = span_key(identity, ids, (), "globex")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 30, 3, len(ids), 64, generator=g)
    writer, reader, stranger = (_store(redis_url, s) for s in (b"w" * 32, b"w" * 32, b"x" * 32))
    try:
        writer.put(CompiledSpan(key, ids, k, v, compile_ms=3.0))
        remote = [t for t in writer.kv.tiers if t.name == "redis"][0]
        assert remote.wait_visible(key)
        got = reader.get(key)  # another server with the same secret: a hit from Redis
        assert got is not None and torch.equal(got.k, k) and torch.equal(got.v, v) and got.token_ids == ids
        assert stranger.get(key) is None
        # another secret does not even find the entry (before: it found it by its public name, failed the
        # MAC, counted it corrupt and deleted it from the shared Redis under the writer's feet)
        assert stranger.kv.stats()["redis"]["corrupt"] == 0 and remote.contains(key)
    finally:
        _close(writer, reader, stranger)
