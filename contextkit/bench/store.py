"""``contextkit bench store``: put/get of real span KV per kvstore tier, beside the raw baseline of the
same bytes measured in the same run, and fetch time against compiling the span.

Tiers: ``memory`` (ours, in process), ``lmcache-cpu`` (LMCache LocalCPUBackend), ``disk`` (LMCache
LocalDiskBackend, page cache warm), ``lm`` (lmcache_server) and ``redis`` (Redis via LMCache). Spans are
real: the default model's KV of 128 / 1k / 4k tokens of multi-hop passages, compiled by the built-in
engine. Raw baselines: ``torch`` copy of the K and V tensors into preallocated ones (memory), reading
the entry's bytes from a file into a preallocated buffer (disk; the strictest plain file I/O, also
``read()`` for reference), a raw redis-py GET of the entry's bytes (remote). A get here is everything a
caller needs: fetch, checks (xxh3 checksum, key digest, tenant), tensors ready.

Options (``--set``): ``sizes`` (128,1024,4096), ``tiers`` (comma list), ``redis_url`` / ``lmcache_url``
(else the bench starts its own servers on loopback and stops them), ``dtype`` (the engine's, float32).
``disk-aes`` and ``redis-aes`` are the same tiers with encryption at rest (AES-256-GCM on the payload).
Summary: ``memory_get_vs_copy``, ``disk_get_vs_read``, ``remote_get_vs_redis`` (Redis tier) and
``lm_get_vs_redis`` (lmcache_server tier), our time / raw time at 1k tokens (<= 2.0 means >= 50% of the
raw bandwidth); ``fetch_vs_compile_max``: the slowest tier's 1k-token fetch / compiling the span;
``disk_aes_get_vs_plain``, ``redis_aes_get_vs_plain`` (and ``_put_``): encrypted tier / plain tier; ``mac_ms``,
``encode_aes_ms``, ``decode_aes_ms``: the keyed MAC and AES-GCM on the 1k-token entry alone.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from contextkit.bench.harness import (
    BenchContext,
    BenchResult,
    Tick,
    percentile,
    time_ms,
)
from contextkit.core.errors import ConfigError
from contextkit.kvstore.entry import decode, encode, encode_bytes, mac
from contextkit.spans.compile import compile_span, model_identity
from contextkit.spans.store import LAYOUT

TIERS = ("memory", "lmcache-cpu", "disk", "lm", "redis", "disk-aes", "redis-aes")


def _tokens(n: int, tokenizer) -> tuple[int, ...]:
    from contextkit.bench.data import load_records

    ids: list[int] = []
    for r in load_records(None):
        for p in r.passages:
            ids += tokenizer.encode(p.text + "\n")
            if len(ids) >= n:
                return tuple(ids[:n])
    return tuple((ids * (n // max(1, len(ids)) + 1))[:n])


def _start_services(ctx: BenchContext, tiers: list[str], services: list) -> dict[str, str]:
    """The Redis and lmcache_server URLs the tiers need: given by ``--set``, else started (into ``services``)."""
    from contextkit.integrations.launchers.services import lmcache_server, redis_server

    urls = {"redis": ctx.option("redis_url", ""), "lm": ctx.option("lmcache_url", "")}
    for name, make in (("redis", redis_server), ("lm", lmcache_server)):
        if (name in tiers or f"{name}-aes" in tiers) and not urls[name]:
            services.append(make().start())
            urls[name] = services[-1].url
    return urls


def _make_tier(name: str, *, urls: dict[str, str], tmp: Path, mac_key: bytes, enc_key: bytes):
    from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
    from contextkit.kvstore.memory import MemoryTier

    return {
        "memory": lambda: MemoryTier(4 << 30),
        "lmcache-cpu": lambda: LMCacheTier(LMCacheTierConfig("cpu", max_bytes=2 << 30, mac_key=mac_key), "lmcache-cpu"),
        "disk": lambda: LMCacheTier(LMCacheTierConfig("disk", disk_dir=tmp / "disk", pool_bytes=1 << 30,
                                                      mac_key=mac_key)),
        "lm": lambda: LMCacheTier(LMCacheTierConfig("remote", remote_url=urls["lm"], pool_bytes=1 << 30,
                                                    mac_key=mac_key)),
        "redis": lambda: LMCacheTier(LMCacheTierConfig("remote", remote_url=urls["redis"], pool_bytes=1 << 30,
                                                       mac_key=mac_key, timeout_s=30)),
        "disk-aes": lambda: LMCacheTier(LMCacheTierConfig("disk", disk_dir=tmp / "disk-aes", pool_bytes=1 << 30,
                                                          mac_key=mac_key, enc_key=enc_key), "disk-aes"),
        "redis-aes": lambda: LMCacheTier(LMCacheTierConfig("remote", remote_url=urls["redis"], pool_bytes=1 << 30,
                                                           mac_key=mac_key, enc_key=enc_key, timeout_s=30),
                                         "redis-aes"),
    }[name]()  # fmt: skip


@dataclass
class _Bench:
    """What every span size is measured with: the engine that compiles it, the keys, the tiers."""

    engine: Any
    tok: Any
    identity: Any
    rerot: Any
    mac_key: bytes
    enc_key: bytes
    reps: int
    tmp: Path
    tiers: list[str]
    made: dict
    raw_redis: Any
    tick: Tick


def _baselines(b: _Bench, n: int, compiled, blob: bytes) -> tuple[dict, list[float]]:
    """The raw baselines on the same bytes, per tier (name, times), and a plain ``read()`` of the file."""
    dk, dv = torch.empty_like(compiled.k), torch.empty_like(compiled.v)
    copy = time_ms(lambda: (dk.copy_(compiled.k), dv.copy_(compiled.v)), b.reps)
    raw_file = b.tmp / f"raw-{n}.bin"
    raw_file.write_bytes(blob)
    buf = bytearray(len(blob))

    def readinto():
        with open(raw_file, "rb", buffering=0) as f:
            f.readinto(buf)

    read = time_ms(readinto, b.reps, warmup=1)
    read_plain = time_ms(raw_file.read_bytes, b.reps)
    redis_get = None
    if b.raw_redis is not None:
        b.raw_redis.set(f"raw-{n}", blob)
        redis_get = time_ms(lambda: b.raw_redis.get(f"raw-{n}"), b.reps, warmup=1)
    baseline = {"memory": ("copy", copy), "lmcache-cpu": ("copy", copy), "disk": ("file read", read),
                "lm": ("redis GET", redis_get), "redis": ("redis GET", redis_get),
                "disk-aes": ("file read", read), "redis-aes": ("redis GET", redis_get)}
    return baseline, read_plain


def _crypto(b: _Bench, entry, key, mb: float) -> dict:
    """What authenticating and encrypting cost on their own, on this entry's bytes."""
    chunks = encode(entry, b.mac_key)
    mac_ms = time_ms(lambda: mac(b.mac_key, chunks[:-1]), b.reps)
    enc_ms = time_ms(lambda: encode(entry, b.mac_key, b.enc_key), b.reps)
    sealed = encode_bytes(entry, b.mac_key, b.enc_key)
    dec_ms = time_ms(lambda: decode(sealed, key, b.mac_key, enc_key=b.enc_key), b.reps)
    return {"mac_ms": statistics.median(mac_ms), "encode_aes_ms": statistics.median(enc_ms),
            "decode_aes_ms": statistics.median(dec_ms), "mb": mb}


def _tier_row(b: _Bench, name: str, n: int, *, compiled, entry, mb: float, baseline: dict,
              read_plain: list[float], compile_ms: float) -> dict:
    """Put, check and time gets of the entry on tier ``name``; the entry is deleted after."""
    key = compiled.key
    tier = b.made[name]
    put = time_ms(lambda: tier.put(key, entry), 1)
    visible = tier.wait_visible(key, 60) if hasattr(tier, "wait_visible") else True
    if not visible:
        raise ConfigError(f"tier {name} never made the {n}-token entry readable")
    got = tier.get(key)
    if got is None or not torch.equal(got.tensors["k"], compiled.k):
        raise ConfigError(f"tier {name} returned a wrong or missing entry")
    get = time_ms(lambda: tier.get(key), b.reps)
    base_name, base = baseline[name]
    row = {
        "tier": name, "tokens": n, "mb": round(mb, 2),
        "get_ms_p50": round(percentile(get, 50), 3), "get_ms_p99": round(percentile(get, 99), 3),
        "get_gb_s": round(mb / 1e3 / (statistics.median(get) / 1e3), 2),
        "put_ms": round(put[0], 3),
        "baseline": base_name,
        "baseline_ms_p50": round(percentile(base, 50), 3) if base else None,
        "get_vs_baseline": round(statistics.median(get) / statistics.median(base), 3) if base else None,
        "fetch_vs_compile": round(statistics.median(get) / compile_ms, 5),
        "compile_ms": round(compile_ms, 1),
        "file_read_plain_ms_p50": round(percentile(read_plain, 50), 3) if name == "disk" else None,
        "default": name == "memory",
        "encrypted": name.endswith("-aes"),
    }  # fmt: skip
    tier.delete(key)
    return row


def _measure_size(b: _Bench, n: int) -> tuple[list[dict], float, dict]:
    """One span size: compile it, the baselines, then every tier; (rows, compile ms, crypto costs)."""
    from contextkit.core.types import Span
    from contextkit.kvstore.entry import make_entry

    span = Span(_tokens(n, b.tok))
    t0 = time.perf_counter()
    compiled = compile_span(b.engine, b.identity, span, b.rerot)
    compile_ms = (time.perf_counter() - t0) * 1e3
    ids = torch.tensor(span.token_ids, dtype=torch.int64)
    entry = make_entry(compiled.key, {"k": compiled.k, "v": compiled.v, "token_ids": ids}, LAYOUT, compile_ms)
    blob = encode_bytes(entry, b.mac_key)
    mb = len(blob) / 1e6
    baseline, read_plain = _baselines(b, n, compiled, blob)
    crypto = _crypto(b, entry, compiled.key, mb)
    b.tick(f"{n} tokens: baselines")
    rows = []
    for name in b.tiers:
        rows.append(_tier_row(b, name, n, compiled=compiled, entry=entry, mb=mb, baseline=baseline,
                              read_plain=read_plain, compile_ms=compile_ms))
        b.tick(f"{n} tokens: {name}")
    return rows, compile_ms, crypto


def _summary(rows: list[dict], sizes: list[int], compile_ms: dict, crypto: dict, *, reps: int, dtype: str) -> dict:
    at = {(r["tier"], r["tokens"]): r for r in rows}
    pick = 1024 if 1024 in sizes else sizes[len(sizes) // 2]
    summary: dict = {"reps": reps, "tokens": pick, "dtype": dtype, "compile_ms": round(compile_ms[pick], 1)}
    for name, keyname in (("memory", "memory_get_vs_copy"), ("disk", "disk_get_vs_read"),
                          ("redis", "remote_get_vs_redis"), ("lm", "lm_get_vs_redis"),
                          ("lmcache-cpu", "lmcache_cpu_get_vs_copy")):
        if (name, pick) in at:
            summary[keyname] = at[(name, pick)]["get_vs_baseline"]
            summary[keyname + "_worst"] = max(r["get_vs_baseline"] for r in rows if r["tier"] == name)
    for name in ("disk", "redis"):  # encryption at rest, against the same tier without it
        if (name, pick) in at and (f"{name}-aes", pick) in at:
            summary[f"{name}_aes_get_vs_plain"] = round(
                at[(f"{name}-aes", pick)]["get_ms_p50"] / at[(name, pick)]["get_ms_p50"], 3)
            summary[f"{name}_aes_put_vs_plain"] = round(
                at[(f"{name}-aes", pick)]["put_ms"] / max(1e-3, at[(name, pick)]["put_ms"]), 3)
    c = crypto[pick]
    summary.update(mac_ms=round(c["mac_ms"], 3), mac_gb_s=round(c["mb"] / c["mac_ms"], 2),
                   encode_aes_ms=round(c["encode_aes_ms"], 3), decode_aes_ms=round(c["decode_aes_ms"], 3),
                   aes_gb_s=round(c["mb"] / c["decode_aes_ms"], 2))
    fetch = [r["fetch_vs_compile"] for r in rows if r["tokens"] == pick]
    summary["fetch_vs_compile_max"] = max(fetch) if fetch else None
    return summary


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.core.models import resolve_model_dir
    from contextkit.core.tenancy import derive
    from contextkit.core.tokenizer import Tokenizer
    from contextkit.engine import Engine
    from contextkit.kernels.rerotate import Rerotator

    secret = ctx.config.load_secret()
    mac_key = derive(secret, "kv-mac")  # every entry leaving the process carries a MAC
    enc_key = derive(secret, "kv-enc")  # the -aes tiers encrypt at rest too
    sizes = [int(s) for s in ctx.option("sizes", "128,1024,4096").split(",")]
    tiers = ctx.option("tiers", ",".join(TIERS)).split(",")
    bad = [t for t in tiers if t not in TIERS]
    if bad:
        raise ConfigError(f"unknown tiers {bad}; choose from {', '.join(TIERS)}")
    dtype = ctx.option("dtype", ctx.config.dtype)
    reps = ctx.count(20)
    model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
    engine = Engine.from_dir(model_dir, dtype)
    tok = Tokenizer(model_dir)
    identity = model_identity(engine, tok.fingerprint)
    rerot = Rerotator("auto", build_dir=ctx.config.cache_dir / "kernels")

    services, made = [], {}
    tmp = Path(tempfile.mkdtemp(prefix="ctxkit-bench-store-"))
    try:
        urls = _start_services(ctx, tiers, services)
        for name in tiers:
            made[name] = _make_tier(name, urls=urls, tmp=tmp, mac_key=mac_key, enc_key=enc_key)
        import redis as redis_py

        rurl = urllib.parse.urlparse(urls["redis"]) if urls.get("redis") else None
        raw_redis = redis_py.Redis(host=rurl.hostname, port=rurl.port) if rurl else None
        b = _Bench(engine, tok, identity, rerot, mac_key, enc_key, reps, tmp, tiers, made, raw_redis, tick)
        rows, compile_ms, crypto = [], {}, {}
        tick(total=len(sizes) * (len(tiers) + 1))
        for n in sizes:
            size_rows, compile_ms[n], crypto[n] = _measure_size(b, n)
            rows += size_rows
    finally:
        for t in made.values():
            t.close()
        for s in services:
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the disk tiers' files and the raw-file baseline
    summary = _summary(rows, sizes, compile_ms, crypto, reps=reps, dtype=dtype)
    config = {"sizes": sizes, "tiers": tiers, "reps": reps, "dtype": dtype, "model": ctx.config.model,
              "redis": "started by the bench" if not ctx.option("redis_url", "") else ctx.option("redis_url", ""),
              "lmcache_server": ("started by the bench" if not ctx.option("lmcache_url", "")
                                 else ctx.option("lmcache_url", ""))}
    return BenchResult("store", config, rows, summary)


def plot(result: BenchResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for tier in dict.fromkeys(r["tier"] for r in result.rows):
        rs = [r for r in result.rows if r["tier"] == tier]
        ax.plot([r["tokens"] for r in rs], [r["get_ms_p50"] for r in rs], marker="o", label=tier)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("span tokens")
    ax.set_ylabel("get ms p50")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
