"""Fixtures of the kvstore tests: the tests' deployment key, store keys and entries with real KV shapes, and
a bit-exact comparison of two entries."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import pytest
import torch

from contextkit.kvstore.entry import Entry, make_entry

MAC = bytes(range(32))  # the tests' deployment key for entry MACs


@dataclass(frozen=True, slots=True)
class Key:
    """A store key as the span cache and the connector make them: a digest and the tenant it belongs to."""

    digest: str
    tenant: str = ""


def make_key(name, tenant: str = "") -> Key:
    # the tenant is hashed in, as the real keys do: one name under two tenants is two digests
    return Key(hashlib.sha256(f"{tenant}\x00{name}".encode()).hexdigest(), tenant)


def make_test_entry(k: Key, tokens: int = 64, dtype=torch.bfloat16, seed: int = 0, cost_ms: float = 10.0) -> Entry:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 30, 3, tokens, 64, generator=g).to(dtype)  # SmolLM2's KV geometry
    return make_entry(k, {"k": kv[0], "v": kv[1], "token_ids": torch.arange(tokens)}, "test", cost_ms)


def same_entry(a: Entry | None, b: Entry | None) -> bool:
    return a is not None and b is not None and a.tensors.keys() == b.tensors.keys() and all(
        a.tensors[n].dtype == b.tensors[n].dtype and torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors
    )


@pytest.fixture(scope="session")
def mac() -> bytes:
    """The deployment key the tests' tiers sign entries with (32 bytes)."""
    return MAC


@pytest.fixture(scope="session")
def key():
    """``key(name, tenant="")``: a store key; the same name and tenant give the same key."""
    return make_key


@pytest.fixture(scope="session")
def entry():
    """``entry(key, tokens=64, dtype=bfloat16, seed=0, cost_ms=10.0)``: an entry of seeded random KV in
    SmolLM2's geometry for ``key`` (the same arguments give the same tensors)."""
    return make_test_entry


@pytest.fixture(scope="session")
def same():
    """``same(a, b)``: both entries present, with the same tensor names, dtypes and bits."""
    return same_entry
