"""A stored KV entry: named tensors plus the metadata needed to check them, and its byte format.

kvstore does not know what a span is. It stores ``Entry`` objects under a key that has a ``digest``
(hex string naming everything that determines the bytes) and a ``tenant`` (the tenant's name). The span cache
puts a span's K, V and token ids in one entry and checks the span-level meaning itself.

Byte format (disk and remote tiers), little-endian:
``MAGIC (8 bytes) | header length (u32) | header (JSON) | payload (the tensors' bytes) | MAC (32 bytes)``.
The header names the key by its ``StoreNames`` (keyed hashes of the digest and of the tenant, never the
digest or the name: both are hashes of public things, the model's fingerprint, the tenant's name, the
tokens, so whoever reads the store could otherwise compute them for a guessed document and look it up),
the tensors' names, shapes and dtypes, the payload length and, for a plain payload, its xxh3-64
checksum. The MAC is keyed BLAKE3 over everything before it, under a key derived
from the deployment's secret (``contextkit.core.tenancy.derive(secret, "kv-mac")``): bytes anyone with
write access to Redis or the disk put there without the secret (a copied header over swapped tensors,
a recomputed checksum) fail it. ``decode`` refuses anything that does not match exactly (a wrong MAC,
truncated, extended, flipped bits, another key's bytes), and the caller drops the entry and recomputes.
Encryption at rest (``KVStoreConfig.encrypt``, off by default): the payload (K, V and the token ids)
is AES-256-GCM ciphertext under a key derived from the same secret (``derive(secret, "kv-enc")``), a
fresh 96-bit nonce per entry in the header; the MAC still covers header and ciphertext, GCM's tag the
plaintext, and the header then carries no checksum of the plaintext (one would confirm a guessed
document's KV). What a shared tier exposes then: keyed names, tensor shapes (so the token count),
sizes, times. Without it, whoever reads Redis or the disk reads the token ids (the documents' text)
and their KV.

Entries written before the names were keyed (format v3) are never looked up under the new names: they
miss, and the tiers' own eviction removes them.
"""

from __future__ import annotations

import hmac
import json
import os
import struct
import time
import warnings
from dataclasses import dataclass, field

import blake3
import torch
import xxhash

from contextkit.core.errors import CorruptEntryError, KVCacheError
from contextkit.core.tenancy import derive
from contextkit.core.tenant import Tenant

MAGIC = b"CTXKV\x00\x04\x00"  # v4: keyed names in the header (v3: a keyed MAC after the payload)
MAC_BYTES = 32
ENC_KEY_BYTES = 32
ENC_ALG = "aes-256-gcm"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8,
)}  # fmt: skip


@dataclass(frozen=True, slots=True)
class EntryMeta:
    digest: str  # the key's digest
    tenant: str  # tenant; part of the digest too, checked again on read
    tensors: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype) in payload order
    layout: str  # what the tensors mean, for humans and version checks, e.g. "k,v:(layers,heads,tokens,dim)"
    nbytes: int  # payload bytes
    checksum: int  # xxh3-64 of the payload
    cost_ms: float = 0.0  # what recomputing it costs (compile time): cost-aware eviction weighs it
    created: float = 0.0


@dataclass(frozen=True, slots=True)
class Entry:
    meta: EntryMeta
    tensors: dict[str, torch.Tensor] = field(hash=False, compare=False)
    # True when the tensors view a buffer someone else lends (LMCache's pool): read them, copy out of
    # them, but keep them only as long as needed; ``owned()`` gives a copy to keep.
    borrowed: bool = field(default=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    def check_for(self, key) -> None:
        """Refuse to store this entry under a key it was not made for."""
        if self.meta.digest != key.digest or self.meta.tenant != key.tenant:
            raise ValueError("entry was made for another key")

    def owned(self) -> Entry:
        """This entry with tensors in memory of its own (a copy if they were borrowed)."""
        if not self.borrowed:
            return self
        return Entry(self.meta, {n: t.clone() for n, t in self.tensors.items()})


def _bytes_of(t: torch.Tensor) -> memoryview:
    t = t.detach().contiguous().cpu()
    return memoryview(t.view(torch.uint8).reshape(-1).numpy()) if t.numel() else memoryview(b"")


def make_entry(key, tensors: dict[str, torch.Tensor], layout: str, cost_ms: float = 0.0) -> Entry:
    """An entry for ``key`` (anything with ``.digest`` and ``.tenant``) holding ``tensors``."""
    Tenant(key.tenant)  # a name no tenant could have is refused here too, not only at the edge
    crc, nbytes, specs = xxhash.xxh3_64(), 0, []
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise KVCacheError(f"tensor {name!r} has dtype {t.dtype}, which the store does not keep")
        b = _bytes_of(t)
        crc.update(b)
        nbytes += b.nbytes
        specs.append((name, tuple(t.shape), dtype))
    meta = EntryMeta(key.digest, key.tenant, tuple(specs), layout, nbytes, crc.intdigest(), float(cost_ms), time.time())
    return Entry(meta, dict(tensors))


@dataclass(frozen=True, slots=True)
class StoreNames:
    """What a key is called outside this process: keyed hashes of its digest and of its tenant.

    The key is derived from the MAC key (itself ``derive(secret, "kv-mac")``), so it reaches every tier
    the way the MAC key does (``LMCacheTierConfig.mac_key``) with nothing more to configure: processes that
    share the secret name a key alike and hit each other's entries; another secret names it otherwise; a
    reader without it cannot compute any name from a guessed document.
    """

    key: bytes = field(repr=False)

    @classmethod
    def of(cls, mac_key: bytes) -> StoreNames:
        return cls(derive(_check_key(mac_key), "kv-names"))

    def digest(self, digest: str) -> str:
        """The key's name outside the process (64 hex)."""
        return blake3.blake3(b"digest\x00" + digest.encode(), key=self.key).hexdigest()

    def tenant(self, tenant: str) -> str:
        """The tenant's tag (32 hex): tells tenants apart, names none of them."""
        return blake3.blake3(b"tenant\x00" + tenant.encode(), key=self.key).hexdigest()[:32]


def mac(mac_key: bytes, chunks) -> bytes:
    """The keyed BLAKE3 MAC (32 bytes) of header and payload chunks."""
    h = blake3.blake3(key=mac_key)
    for c in chunks:
        h.update(c)
    return h.digest()


def _aead(enc_key: bytes):
    if not isinstance(enc_key, bytes) or len(enc_key) != ENC_KEY_BYTES:
        raise KVCacheError(f"a KV encryption key is {ENC_KEY_BYTES} bytes "
                           "(contextkit.core.tenancy.derive(secret, 'kv-enc'))")
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:
        raise KVCacheError("encrypted KV entries need the cryptography package: pip install cryptography") from exc
    return AESGCM(enc_key)


def encode(entry: Entry, mac_key: bytes, enc_key: bytes | None = None) -> list[memoryview | bytes]:
    """The entry as byte chunks (header, each tensor's bytes without a copy, then the MAC). With
    ``enc_key`` the tensors' bytes go as one AES-256-GCM ciphertext instead. The header names the key
    and tenant by their ``StoreNames``."""
    m, names = entry.meta, StoreNames.of(mac_key)
    fields = {
        "digest": names.digest(m.digest), "tenant": names.tenant(m.tenant), "layout": m.layout,
        "nbytes": m.nbytes, "cost_ms": m.cost_ms, "created": m.created,
        "tensors": [[n, list(s), d] for n, s, d in m.tensors],
    }  # fmt: skip
    payload: list = [_bytes_of(entry.tensors[n]) for n, _, _ in m.tensors]
    if enc_key is None:
        fields["xxh3_64"] = m.checksum  # of bytes stored in the clear anyway
    else:  # no checksum of the plaintext: it would confirm a guess of it; GCM's tag checks it instead
        nonce = os.urandom(12)
        fields.update(enc=ENC_ALG, nonce=nonce.hex())
        payload = [_aead(enc_key).encrypt(nonce, b"".join(payload), None)]
    header = json.dumps(fields).encode()
    chunks = [MAGIC + struct.pack("<I", len(header)) + header, *payload]
    return [*chunks, mac(_check_key(mac_key), chunks)]


def encode_bytes(entry: Entry, mac_key: bytes, enc_key: bytes | None = None) -> bytes:
    return b"".join(encode(entry, mac_key, enc_key))


def _check_key(mac_key: bytes) -> bytes:
    if not isinstance(mac_key, bytes) or len(mac_key) != MAC_BYTES:
        raise KVCacheError(f"a KV MAC key is {MAC_BYTES} bytes (contextkit.core.tenancy.derive(secret, 'kv-mac'))")
    return mac_key


def _view(payload: memoryview, offset: int, size: int) -> torch.Tensor:
    """A uint8 tensor over ``payload[offset:offset+size]`` without a copy. Entries read from a store are
    read-only by contract (the span cache copies out of them), so an immutable buffer is fine; torch
    only warns that it cannot enforce that."""
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(payload, dtype=torch.uint8, count=size, offset=offset)


def _header(view: memoryview) -> tuple[dict, int]:
    """The parsed header and where the payload starts."""
    (hlen,) = struct.unpack("<I", view[8:12])
    try:
        h = json.loads(bytes(view[12 : 12 + hlen]))
        h["tensors"] = tuple((str(n), tuple(int(x) for x in s), str(d)) for n, s, d in h["tensors"])
        for name, kind in (("digest", str), ("tenant", str), ("layout", str), ("nbytes", int)):
            h[name] = kind(h[name])
        if h.get("enc") is None:
            h["xxh3_64"] = int(h["xxh3_64"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntryError(f"unreadable header ({exc})") from exc
    return h, 12 + hlen


def _names_of(h: dict, key, mac_key: bytes | None) -> tuple[str, str]:
    """The key's digest and tenant, once the header's names are checked to be ``key``'s; without a key,
    the names as stored (nobody without the secret can tell what they name)."""
    if key is None:
        return h["digest"], h["tenant"]
    if mac_key is None:
        raise KVCacheError("decode needs the deployment's mac_key to check an entry against its key")
    names = StoreNames.of(mac_key)
    if h["digest"] != names.digest(key.digest) or h["tenant"] != names.tenant(key.tenant):
        raise CorruptEntryError("entry belongs to another key or tenant")
    return key.digest, key.tenant


def decode(data: bytes | bytearray | memoryview, key=None, mac_key: bytes | None = None, verify: bool = True,
           borrowed: bool = False, enc_key: bytes | None = None) -> Entry:
    """Parse and check stored bytes: the MAC first (``mac_key``, the deployment's), then with ``key`` that
    they belong to it. ``verify=False`` skips the MAC (bytes this process wrote and never let out). An
    encrypted entry is decrypted with ``enc_key`` (its tensors are then a copy, never ``borrowed``);
    plain entries are read with or without it.

    Raises:
        CorruptEntryError: anything does not match; the message says what.
    """
    view = memoryview(data)
    if len(view) < 12 + MAC_BYTES or bytes(view[:8]) != MAGIC:
        raise CorruptEntryError("not a contextkit KV entry (bad magic, or written before v4: recomputed)")
    tag, view = bytes(view[-MAC_BYTES:]), view[:-MAC_BYTES]
    if verify and not hmac.compare_digest(tag, mac(_check_key(mac_key), [view])):
        raise CorruptEntryError("MAC mismatch: not written with this deployment's secret, or altered")
    h, start = _header(view)
    digest, tenant = _names_of(h, key, mac_key)  # before decrypting: another key's entry costs nothing more
    payload = view[start:]
    if h.get("enc") is not None:
        if h["enc"] != ENC_ALG:
            raise CorruptEntryError(f"unknown encryption {h['enc']!r}")
        if enc_key is None:
            raise CorruptEntryError("the entry is encrypted and this store has no key (set kvstore encrypt)")
        from cryptography.exceptions import InvalidTag

        try:
            payload = memoryview(_aead(enc_key).decrypt(bytes.fromhex(h["nonce"]), bytes(payload), None))
        except (InvalidTag, ValueError, KeyError) as exc:
            raise CorruptEntryError("the entry does not decrypt with this deployment's key") from exc
        borrowed = False
    if len(payload) != h["nbytes"]:
        raise CorruptEntryError(f"payload is {len(payload)} bytes, header says {h['nbytes']} (truncated?)")
    if h.get("enc") is not None:
        checksum = xxhash.xxh3_64_intdigest(payload)  # GCM checked the plaintext; the meta still names it
    else:
        checksum = h["xxh3_64"]
        if not verify and xxhash.xxh3_64_intdigest(payload) != checksum:  # else the MAC covered it
            raise CorruptEntryError("checksum mismatch")
    meta = EntryMeta(digest, tenant, h["tensors"], h["layout"], h["nbytes"], checksum,
                     float(h.get("cost_ms", 0.0)), float(h.get("created", 0.0)))
    tensors, off = {}, 0
    for name, shape, dtype in meta.tensors:
        if dtype not in _DTYPES:
            raise CorruptEntryError(f"unknown dtype {dtype!r}")
        dt = _DTYPES[dtype]
        n = 1
        for s in shape:
            n *= s
        size = n * torch.empty((), dtype=dt).element_size()
        if off + size > len(payload):
            raise CorruptEntryError("tensor shapes exceed the payload")
        t = _view(payload, off, size)
        tensors[name] = t.view(dt).reshape(shape)
        off += size
    if off != meta.nbytes:
        raise CorruptEntryError("tensor shapes do not cover the payload")
    return Entry(meta, tensors, borrowed)
