"""What a shared tier shows to whoever can read it (issue #26, point 9).

A span key's digest is a hash of public things (model and tokenizer fingerprints, the tenant's name, the
token ids), so anyone who can read Redis could compute it for a guessed document and look for it: a
membership oracle ("is this contract cached for acme?"). The names and headers a tier writes are keyed by
the deployment's secret instead: servers that share the secret find each other's entries, a reader without
it can compute none of them. Tested on the real Redis (``CONTEXTKIT_REDIS_URL``), through the real LMCache
tier, with the span cache's and the vLLM connector's real key functions.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
import redis
import torch

from contextkit.core.tenancy import derive
from contextkit.integrations.vllm_connector.keys import KVGeometry, block_keys
from contextkit.integrations.vllm_connector.keys import span_key as connector_span_key
from contextkit.kernels.rope import RopeSpec
from contextkit.kvstore.entry import make_entry
from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
from contextkit.spans.key import ModelIdentity, span_key

pytestmark = pytest.mark.slow

TENANT = "acme-legal-private"
# the guessed document: the attacker knows the model, the tokenizer and the tenant's name, and guesses the text
DOC = tuple(range(1000, 1077))
IDENTITY = ModelIdentity(model=hashlib.sha256(b"SmolLM2-135M-Instruct").hexdigest(), tokenizer="smollm2-tok",
                         dtype="bfloat16", rope=(RopeSpec(64, 100000.0),))
GEOMETRY = KVGeometry(hashlib.sha256(b"SmolLM2-135M-Instruct").hexdigest(), "bfloat16", 32, 30, 3, 64)
SALT = "0123abcd" * 8  # a cache_salt as the proxy sends it


def _keys():
    """The same document as each store names it: a span of the span cache, a block and a span of the
    connector (under the tenant's cache_salt)."""
    return {"span cache": span_key(IDENTITY, DOC, (), TENANT),
            "connector block": block_keys(GEOMETRY, SALT, DOC, 2)[1],
            "connector span": connector_span_key(GEOMETRY, SALT, DOC)}


def _entry(k, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, 30, 3, n, 64, generator=g).to(torch.bfloat16)
    return make_entry(k, {"k": kv[0], "v": kv[1], "token_ids": torch.tensor(DOC[:n])}, "test", 5.0)


def _tier(redis_url: str, secret: bytes, encrypt: bool = True) -> LMCacheTier:
    """A Redis tier as a server with ``secret`` builds it (kit.py, the connector: keys derived from it).
    A generous deadline: a busy shared machine must not turn a slow read into a miss here."""
    return LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, timeout_s=30,
                                         mac_key=derive(secret, "kv-mac"),
                                         enc_key=derive(secret, "kv-enc") if encrypt else None))


def _close(*tiers) -> None:
    for t in tiers:
        done = threading.Event()
        threading.Thread(target=lambda t=t: (t.close(), done.set()), daemon=True).start()
        assert done.wait(30), "a tier did not close"


def _stored(r: redis.Redis, tier: LMCacheTier, k) -> bytes:
    """Everything Redis holds for ``k``: its key names and their values."""
    name = tier._key(k).to_string()
    parts = [name.encode()]
    for suffix in ("kv_bytes", "metadata"):
        value = r.get(name + suffix)
        assert value is not None, f"{name + suffix} is not in Redis"
        parts += [(name + suffix).encode(), value]
    return b"\n".join(parts)


def test_stored_names_depend_on_the_secret(redis_url, same):
    """(a) Two servers sharing a secret give one document one name and hit each other's entries; a server
    with another secret gives it another name: it does not find ours (a miss, not a refused entry)."""
    one, same_secret, other = (_tier(redis_url, s) for s in (b"s" * 32, b"s" * 32, b"t" * 32))
    try:
        for what, k in _keys().items():
            assert one._key(k).to_string() == same_secret._key(k).to_string(), what
            assert one._key(k).to_string() != other._key(k).to_string(), what
            e = _entry(k, k.num_tokens)
            one.put(k, e)
            assert one.wait_visible(k), what
            assert same(same_secret.get(k), e), (what, same_secret.stats())  # the other server's still hit
            assert other.get(k) is None, what
        assert other.stats()["corrupt"] == 0  # never even found: names differ, nothing was read and refused
    finally:
        _close(one, same_secret, other)


def test_redis_holds_nothing_a_guessed_document_could_be_matched_against(redis_url, same):
    """(b) An encrypted entry in the real Redis: its names and bytes hold neither the tenant's name, nor
    the plaintext's xxh3, nor any digest computable from the guessed document without the secret."""
    r = redis.Redis.from_url(redis_url)
    tier = _tier(redis_url, b"s" * 32)
    try:
        for what, k in _keys().items():
            e = _entry(k, k.num_tokens)
            before = set(r.scan_iter(count=1000))
            tier.put(k, e)
            assert tier.wait_visible(k) and same(tier.get(k), e), what  # it is there and reads back
            stored = _stored(r, tier, k)
            new_names = b"\n".join(set(r.scan_iter(count=1000)) - before)  # whatever else the put wrote
            guessable = {
                "tenant name": TENANT.encode(), "cache_salt": SALT.encode(), "key tenant": k.tenant.encode(),
                "digest": k.digest.encode(), "64-bit chunk hash": f"{int(k.digest[:16], 16):x}".encode(),
                "tenant hash": hashlib.sha256(k.tenant.encode()).hexdigest()[:12].encode(),
                "xxh3 (decimal)": str(e.meta.checksum).encode(), "xxh3 (hex)": f"{e.meta.checksum:016x}".encode(),
                "xxh3 (bytes)": e.meta.checksum.to_bytes(8, "little"),
            }
            for label, value in guessable.items():
                if label == "key tenant" and what == "span cache":
                    continue  # the span cache's tenant is the name itself: checked above
                assert value not in stored, f"{what}: Redis holds the {label}"
            for label in ("digest", "64-bit chunk hash", "tenant hash"):
                assert guessable[label] not in new_names, f"{what}: a Redis key name holds the {label}"
    finally:
        _close(tier)


def test_a_tampered_or_misplaced_entry_in_redis_is_refused_and_recomputed(redis_url, same):
    """(c) The checks still hold with keyed names and no plaintext checksum: a flipped byte (header or
    ciphertext) or another key's bytes under this key's name is dropped, counted and recomputed."""
    r = redis.Redis.from_url(redis_url)
    tier = _tier(redis_url, b"s" * 32)
    try:
        k, neighbour = span_key(IDENTITY, DOC, (), TENANT), span_key(IDENTITY, DOC[1:], (), TENANT)
        e = _entry(k, len(DOC))
        name = tier._key(k).to_string() + "kv_bytes"
        for offset in (20, -100):  # in the header; in the ciphertext
            tier.put(k, e)
            assert tier.wait_visible(k)
            data = bytearray(r.get(name))
            data[offset] ^= 0x01
            r.set(name, bytes(data))
            corrupt = tier.stats()["corrupt"]
            assert tier.get(k) is None and tier.stats()["corrupt"] == corrupt + 1, offset
            assert not r.exists(name), offset  # dropped, not left for the next reader
        tier.put(neighbour, _entry(neighbour, len(DOC) - 1, seed=1))
        assert tier.wait_visible(neighbour)
        tier.put(k, e)  # recomputed
        assert tier.wait_visible(k) and same(tier.get(k), e)
        theirs = tier._key(neighbour).to_string()
        for suffix in ("kv_bytes", "metadata"):  # a well-formed entry with a good MAC, under the wrong name
            r.set(tier._key(k).to_string() + suffix, r.get(theirs + suffix))
        assert tier.get(k) is None and tier.stats()["corrupt"] == 3
    finally:
        _close(tier)
