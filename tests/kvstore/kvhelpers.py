"""Small helpers shared by the kvstore tests (keys and entries with real KV shapes)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from contextkit.kvstore.entry import make_entry


MAC = bytes(range(32))  # the tests' deployment key for entry MACs


@dataclass(frozen=True, slots=True)
class Key:
    digest: str
    tenant: str = ""


def key(name, tenant: str = "") -> Key:
    return Key(hashlib.sha256(f"{tenant}\x00{name}".encode()).hexdigest(), tenant)


def entry(k: Key, tokens: int = 64, dtype=torch.bfloat16, seed: int = 0, cost_ms: float = 10.0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 30, 3, tokens, 64, generator=g).to(dtype)  # SmolLM2's KV geometry
    return make_entry(k, {"k": kv[0], "v": kv[1], "token_ids": torch.arange(tokens)}, "test", cost_ms)


def same(a, b) -> bool:
    return a is not None and b is not None and a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[n].dtype == b.tensors[n].dtype and torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors
    )
