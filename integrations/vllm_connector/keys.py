"""The connector's store keys: exact-prefix blocks chained from a seeded root, and position-free spans.

Everything that changes the bytes of an entry is in its key (DESIGN.md invariants):
- the model (a fingerprint of its config, tokenizer and weight files' headers and sizes), the KV dtype,
  the block size, the number of layers, KV heads and head size, and the entry layout version;
- the tenant: the request's ``cache_salt`` (which the proxy derives from the API key with a server
  secret). LMCache's own vLLM connector dropped the salt from its keys (LMCache #2878), so one tenant's
  KV could be loaded for another; here two salts never share a key.

A block key chains the digest of the block before it (like vLLM's block hashes), so block i names the
whole prefix up to it; a span key names its tokens alone (it was computed at position 0 with nothing
before it). Every entry stores its token ids too, and a load checks them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

LAYOUT_VERSION = "contextkit-vllm-kv-v1"  # entries: k, v (layers, kv_heads, tokens, head_size); ids (tokens,)


def model_fingerprint(model_dir: str | Path) -> str:
    """A digest of what makes a model's KV: its config, tokenizer, and its weight files' headers and sizes.

    A name or path is not enough (two servers may mount one model at different paths, or a different
    model at one path); hashing gigabytes of weights at every start is too slow. A safetensors file's
    header lists every tensor's name, dtype, shape and offsets, and with the file size it tells models apart.
    """
    root = Path(model_dir)
    h = hashlib.sha256(b"contextkit-model-v1")
    if not root.is_dir():  # a hub name: the name is all we have
        h.update(str(model_dir).encode())
        return h.hexdigest()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        f = root / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        with f.open("rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(f.name.encode() + b"\0" + str(f.stat().st_size).encode() + fh.read(min(n, 64 << 20)))
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The shape and type of one server's KV: what must match for an entry to be loaded."""

    model: str  # model_fingerprint
    dtype: str  # e.g. "bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int

    def root(self, salt: str | None, kind: str) -> bytes:
        """The seed of a key chain of ``kind`` ("block" or "span") for the tenant with ``salt``."""
        payload = json.dumps({"v": LAYOUT_VERSION, "kind": kind, "model": self.model, "dtype": self.dtype,
                              "block": self.block_size, "layers": self.num_layers, "heads": self.num_kv_heads,
                              "head": self.head_size, "salt": salt or ""}, sort_keys=True)
        return hashlib.sha256(payload.encode()).digest()

    def layout(self) -> str:
        return (f"{LAYOUT_VERSION} k,v:(layers,kv_heads,tokens,head_size) {self.dtype} block={self.block_size} "
                f"layers={self.num_layers} heads={self.num_kv_heads} head={self.head_size}")


def tenant_name(salt: str | None) -> str:
    """The kvstore tenant an entry is filed under: a digest of the salt, never the salt itself (and the
    tiers store only a keyed tag of this, ``kvstore.entry.StoreNames``, like every digest here)."""
    return "salt." + hashlib.sha256((salt or "").encode()).hexdigest()[:20] if salt else "unsalted"


@dataclass(frozen=True, slots=True)
class ConnectorKey:
    """A kvstore key (``digest``, ``tenant``) for one block or one span."""

    digest: str
    tenant: str
    num_tokens: int


def _ids_bytes(ids) -> bytes:
    return torch.as_tensor(list(ids), dtype=torch.int64).numpy().tobytes()


def block_keys(geom: KVGeometry, salt: str | None, token_ids, num_blocks: int) -> list[ConnectorKey]:
    """Keys of the first ``num_blocks`` full blocks of ``token_ids``; block i's key names blocks 0..i."""
    bs, tenant = geom.block_size, tenant_name(salt)
    h, out = geom.root(salt, "block"), []
    for i in range(num_blocks):
        h = hashlib.sha256(h + _ids_bytes(token_ids[i * bs : (i + 1) * bs])).digest()
        out.append(ConnectorKey(h.hex(), tenant, bs))
    return out


def span_key(geom: KVGeometry, salt: str | None, token_ids) -> ConnectorKey:
    """The key of a span's position-free KV (computed alone, at positions 0..n-1)."""
    ids = list(token_ids)
    h = hashlib.sha256(geom.root(salt, "span") + _ids_bytes(ids)).hexdigest()
    return ConnectorKey(h, tenant_name(salt), len(ids))
