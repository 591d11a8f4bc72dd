"""Position-free span keys.

A key names everything that changes a span's KV except its position: the model and tokenizer
fingerprints, dtype, the RoPE geometry of every layer, the token ids, what it was allowed to attend to
(the keys of the spans it was compiled after: "prompt depend"), and the tenant it belongs
to. Token ids are hashed in a chain from a seeded root, like vLLM's block hashes, and the stored entry
keeps the ids so that a hit is checked token by token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from contextkit.core.tenant import Tenant
from contextkit.kernels.rope import RopeSpec

_ROOT = b"contextkit-span-v1"
_CHUNK = 256  # tokens per link of the hash chain


def token_digest(token_ids: tuple[int, ...] | list[int]) -> str:
    """sha256 chained over 256-token chunks from a seeded root (hex)."""
    h = hashlib.sha256(_ROOT).digest()
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    for i in range(0, max(len(ids), 1), _CHUNK):
        h = hashlib.sha256(h + ids[i : i + _CHUNK].numpy().tobytes()).digest()
    return h.hex()


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The parts of a key that come from the engine: same for every span of one model and dtype."""

    model: str  # engine fingerprint digest
    tokenizer: str  # tokenizer fingerprint ("" when ids are supplied without a tokenizer)
    dtype: str
    rope: tuple[RopeSpec, ...]  # distinct RoPE geometries, in layer order


@dataclass(frozen=True, slots=True)
class SpanKey:
    identity: ModelIdentity
    tokens: str  # token_digest of the ids
    num_tokens: int
    depends_on: tuple[SpanKey, ...] = ()
    tenant: str = ""  # the tenant's name

    @property
    def digest(self) -> str:
        """A stable hex name for the key. Anyone can compute it from a guessed document, so it never leaves
        the process as it is: the disk and remote tiers store a keyed name of it (``kvstore.entry.StoreNames``)."""
        ident = self.identity
        payload = {
            "model": ident.model,
            "tokenizer": ident.tokenizer,
            "dtype": ident.dtype,
            "rope": [[r.head_dim, r.base, r.layout, r.scaling, r.factor, r.low_freq_factor, r.high_freq_factor,
                      r.original_max_positions] for r in ident.rope],
            "tokens": self.tokens,
            "n": self.num_tokens,
            "deps": [d.digest for d in self.depends_on],
            "tenant": self.tenant,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def span_key(
    identity: ModelIdentity,
    token_ids: tuple[int, ...],
    depends_on: tuple[SpanKey, ...] = (),
    tenant: Tenant | str = "",
) -> SpanKey:
    """The key of ``token_ids`` compiled after ``depends_on`` for ``tenant`` (checked: a name no tenant
    may have is refused here too, not only where requests enter)."""
    return SpanKey(identity, token_digest(token_ids), len(token_ids), depends_on, Tenant.of(tenant).name)
