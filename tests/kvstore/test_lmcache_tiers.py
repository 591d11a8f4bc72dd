"""kvstore tiers on the real LMCache (0.5.6) against real services: local CPU, local disk, lmcache_server
(lm://) and Redis (redis://). Each workaround for LMCache's sharp edges has a test here, and every fault
ends in a miss (the caller recomputes) or a clear error: never a wrong KV, never a hang or a crash."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from contextkit.core.config import REMOTE_SCHEMES
from contextkit.core.errors import ConfigError
from contextkit.integrations.launchers.services import lmcache_server, redis_server
from contextkit.integrations.launchers.vllm_server import free_port
from contextkit.kvstore.entry import decode, encode_bytes
from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig, lmcache_config

pytestmark = pytest.mark.slow


def finishes(fn, within_s: float = 60.0):
    """Run ``fn`` in a thread; fail (not hang) if it does not return. Returns its result."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(within_s)
    assert not t.is_alive(), f"{fn} did not return within {within_s} s"
    return out[0] if out else None


@pytest.fixture
def tiers(tmp_path, redis_url, lmcache_url, mac):
    made = {
        "cpu": LMCacheTier(LMCacheTierConfig("cpu", max_bytes=256 << 20, mac_key=mac)),
        "disk": LMCacheTier(LMCacheTierConfig("disk", disk_dir=tmp_path / "disk", mac_key=mac)),
        "redis": LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, mac_key=mac)),
        "lm": LMCacheTier(LMCacheTierConfig("remote", remote_url=lmcache_url, mac_key=mac)),
    }
    yield made
    for t in made.values():
        finishes(t.close, 30)


def test_every_backend_round_trips_bit_exact_and_keeps_tenants_apart(tiers, tmp_path, key, entry, same):
    for name, tier in tiers.items():
        for dtype in (torch.bfloat16, torch.float32):
            k = key(f"{name}-{dtype}", tenant="tenant-a")
            e = entry(k, 100, dtype, seed=3)
            tier.put(k, e)
            assert tier.wait_visible(k), name
            assert same(tier.get(k), e), name
            assert tier.get(key(f"{name}-{dtype}", tenant="tenant-b")) is None  # other tenant: miss
            assert tier.get(dataclasses.replace(k, tenant="tenant-b")) is None  # same digest, other tenant: miss
        s = tier.stats()
        assert s["hits"] == 2 and s["misses"] >= 4 and s["puts"] == 2 and s["corrupt"] == 0


def test_config_maps_onto_lmcache_keys(tmp_path, mac):
    """LMCache's from_defaults ignores unknown keys silently: check the ones we set took effect."""
    disk = lmcache_config(LMCacheTierConfig("disk", max_bytes=3 << 30, disk_dir=tmp_path, mac_key=mac))
    assert disk.local_disk == str(tmp_path) and disk.max_local_disk_size == 3.0 and not disk.local_cpu
    remote = lmcache_config(LMCacheTierConfig("remote", remote_url="redis://127.0.0.1:1", timeout_s=4, mac_key=mac))
    assert remote.remote_url == "redis://127.0.0.1:1?socket_timeout=2.0&socket_connect_timeout=2.0"
    assert remote.blocking_timeout_secs == 4 and remote.remote_serde == "naive"
    for name, scheme in REMOTE_SCHEMES.items():  # each row's URL: its timeout parameters, after the caller's
        url = lmcache_config(LMCacheTierConfig("remote", remote_url=f"{name}://h:1?db=2", timeout_s=3,
                                               mac_key=mac)).remote_url
        assert url == f"{name}://h:1?db=2" + "".join(f"&{param}=1.5" for param in scheme.timeout_params)
    for bad in (dict(kind="nope"), dict(kind="disk"), dict(kind="remote", remote_url="http://x:1"),
                dict(kind="remote", remote_url="redis://nohostport"), dict(kind="cpu", mac_key=b""),
                dict(kind="cpu", mac_key=b"short")):
        with pytest.raises(ConfigError):
            LMCacheTierConfig(**{"mac_key": mac, **bad})


def _put_under(tier, name_of, e, mac: bytes) -> None:
    """Store ``e``'s bytes (a good MAC, another key's header) under ``name_of``'s LMCache key: what a
    collision of two keys' 64-bit chunk hashes does (keyed, so a test cannot find one to make)."""
    data = bytearray(encode_bytes(e, mac))
    obj = tier._sm.allocate(torch.Size([len(data)]), torch.uint8)
    obj.tensor.reshape(-1).copy_(torch.frombuffer(data, dtype=torch.uint8))
    tier._sm.batched_put([tier._key(name_of)], [obj])


def test_a_colliding_chunk_hash_is_a_miss_not_a_wrong_entry(tiers, mac, key, entry):
    """LMCache keys carry 64 bits of a key's keyed name; two keys equal in those bits (another model's
    span, say) meet in LMCache, and the full name in the entry header refuses the wrong one."""
    first, other = key("first"), key("other")
    for name in ("cpu", "disk", "redis"):
        tier = tiers[name]
        _put_under(tier, other, entry(first, 16, seed=1), mac)
        assert tier.wait_visible(other)
        assert tier.get(other) is None, name
        assert tier.stats()["corrupt"] == 1, name


# One disk tier in a process of its own: "write" stores the entry whose bytes are in the file, "read" writes
# the bytes of what it reads back (nothing on a miss). The test holds the keys and entries; the child only
# needs the key's digest.
CHILD = """
import sys, time
from pathlib import Path
from types import SimpleNamespace
from contextkit.kvstore.entry import decode, encode_bytes
from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
op, disk, mac, digest, path = sys.argv[1], Path(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4], Path(sys.argv[5])
k = SimpleNamespace(digest=digest, tenant="")
tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=disk, mac_key=mac))
if op == "write":
    tier.put(k, decode(path.read_bytes(), k, mac))
    assert tier.wait_visible(k)
    # visible may mean the other writer's file: exit only once this process's own write has left LMCache's
    # queue (put queues it before it returns), so that the exit cuts no write off half-way
    db, ck = tier._disk(), tier._key(k)
    while db.exists_in_put_tasks(ck):
        time.sleep(0.01)
else:
    got = tier.get(k)
    if got is not None:
        path.write_bytes(encode_bytes(got, mac))
tier.close()
"""


def _child(op: str, disk: Path, mac: bytes, k, path: Path, *, hash_seed: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)  # different hash seeds: LMCache's hash() would disagree
    return subprocess.Popen([sys.executable, "-c", CHILD, op, str(disk), mac.hex(), k.digest, str(path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _write(disk: Path, mac: bytes, k, e, *, hash_seed: str) -> subprocess.Popen:
    path = disk.parent / f"entry-{hash_seed}.bin"
    path.write_bytes(encode_bytes(e, mac))
    return _child("write", disk, mac, k, path, hash_seed=hash_seed)


def _read(disk: Path, mac: bytes, k, *, hash_seed: str):
    """What a new process reads from the disk tier under ``k`` (None: a miss)."""
    path = disk.parent / f"read-{hash_seed}.bin"
    proc = _child("read", disk, mac, k, path, hash_seed=hash_seed)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return decode(path.read_bytes(), k, mac) if path.exists() else None


def test_disk_tier_survives_a_restart_across_processes(tmp_path, mac, key, entry, same):
    disk, k = tmp_path / "disk", key("shared")
    w = _write(disk, mac, k, entry(k, 50, seed=7), hash_seed="1")
    assert w.wait(120) == 0, w.stderr.read()
    assert same(_read(disk, mac, k, hash_seed="2"), entry(k, 50, seed=7))  # a new process, another hash seed


def test_two_processes_writing_one_key_leave_one_good_entry(tmp_path, mac, key, entry, same):
    disk, k = tmp_path / "disk", key("shared")
    procs = [_write(disk, mac, k, entry(k, 50, seed=7), hash_seed="3"),
             _write(disk, mac, k, entry(k, 50, seed=8), hash_seed="4")]
    for p in procs:
        assert p.wait(120) == 0, p.stderr.read()
    assert len(list(disk.glob("*.pt"))) == 1 and not list(disk.glob(".tmp-*"))
    got = _read(disk, mac, k, hash_seed="5")
    assert same(got, entry(k, 50, seed=7)) or same(got, entry(k, 50, seed=8))  # one writer's, whole


def test_corrupt_truncated_and_half_written_files_are_dropped_and_recomputed(tmp_path, mac, key, entry, same):
    disk = tmp_path / "disk"
    tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=disk, mac_key=mac))
    try:
        ks = [key(f"f{i}") for i in range(3)]
        for i, k in enumerate(ks):
            tier.put(k, entry(k, 40, seed=i))
            assert tier.wait_visible(k)
        files = {k: Path(tier._disk()._key_to_path(tier._key(k))) for k in ks}
    finally:
        tier.close()
    data = bytearray(files[ks[0]].read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte in the KV
    files[ks[0]].write_bytes(bytes(data))
    files[ks[1]].write_bytes(files[ks[1]].read_bytes()[:1000])  # truncated (a crash mid-write)
    (disk / ".tmp-dead.part").write_bytes(b"partial")  # an atomic write that never finished
    tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=disk, mac_key=mac))
    try:
        assert not (disk / ".tmp-dead.part").exists()
        assert tier.get(ks[0]) is None and tier.get(ks[1]) is None
        assert same(tier.get(ks[2]), entry(ks[2], 40, seed=2))
        assert tier.stats()["corrupt"] == 2
        assert not files[ks[0]].exists() and not files[ks[1]].exists()  # dropped, not kept around
        tier.put(ks[0], entry(ks[0], 40, seed=0))  # recomputed and stored again
        assert tier.wait_visible(ks[0]) and same(tier.get(ks[0]), entry(ks[0], 40, seed=0))
    finally:
        tier.close()


def test_disk_full_is_a_miss_not_a_crash(tmp_path, mac, key, entry, same):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=mnt, mac_key=mac))
        try:
            big, small = key("big"), key("small")
            tier.put(big, entry(big, 200))  # ~4.6 MB of KV on a 1 MB filesystem: the write fails
            deadline = time.monotonic() + 5  # the write is asynchronous: see it start, then fail
            while not list(mnt.glob(".tmp-*")) and time.monotonic() < deadline:
                time.sleep(0.002)
            while list(mnt.glob(".tmp-*")) and time.monotonic() < deadline + 25:
                time.sleep(0.02)  # ...and clean up after itself
            assert tier.get(big) is None
            tier.put(small, entry(small, 8))  # ~90 KB fits
            assert tier.wait_visible(small)
            assert same(tier.get(small), entry(small, 8))
            assert not list(mnt.glob(".tmp-*"))  # the failed write left nothing behind
        finally:
            finishes(tier.close, 30)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.parametrize("make", [redis_server, lmcache_server], ids=["redis", "lmcache_server"])
def test_remote_down_at_start_killed_mid_run_and_back(make, mac, key, entry, same):
    port = free_port()
    # retry_after_s=0: a down tier probes on every call, so each step below sees the server as it is now
    # (no waiting out a back-off window between the steps)
    tier = LMCacheTier(LMCacheTierConfig("remote", remote_url=make(port).url, timeout_s=2, retry_after_s=0.0,
                                         mac_key=mac))
    try:
        k = key("remote")
        e = entry(k, 50)
        finishes(lambda: tier.put(k, e))  # nobody listening: dropped and counted, no exception
        assert finishes(lambda: tier.get(k)) is None
        assert tier.stats()["errors"] >= 1 and tier.stats()["down"]
        server = make(port).start()
        try:
            assert finishes(lambda: tier.contains(k)) is False  # the call probes, reconnects and asks
            tier.put(k, e)
            assert tier.wait_visible(k) and same(tier.get(k), e)
            server.kill()  # SIGKILL mid-run
            assert finishes(lambda: tier.get(k)) is None  # a miss, at once or after the deadline
            finishes(lambda: tier.put(k, e))
            server = make(port).start()  # back (empty: it kept nothing)
            assert finishes(lambda: tier.get(k)) is None
            tier.put(k, e)
            assert tier.wait_visible(k) and same(tier.get(k), e)
        finally:
            server.stop()
    finally:
        finishes(tier.close, 30)  # the Redis close deadlock is worked around: returns


def test_delete_on_every_tier_that_supports_it(tiers, key, entry):
    for name in ("cpu", "disk", "redis"):
        k = key(f"del-{name}")
        tiers[name].put(k, entry(k, 8))
        assert tiers[name].wait_visible(k)
        assert tiers[name].delete(k), name
        assert tiers[name].get(k) is None, name
    assert tiers["lm"].delete(key("x")) is False  # lmcache_server has no delete command


def test_borrowed_buffers_go_back_to_the_pool_and_never_change_under_a_reader(tmp_path, mac, key, entry):
    """A get hands out views of LMCache's pool buffer without a copy. The buffer returns to the pool
    when the last tensor over it is freed, so a small pool serves many gets, and a tensor someone still
    holds is never overwritten by a later get."""
    tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=tmp_path, pool_bytes=32 << 20, mac_key=mac))  # ~6 entries
    try:
        ks = [key(f"b{i}") for i in range(3)]
        for i, k in enumerate(ks):
            tier.put(k, entry(k, 200, seed=i))  # 4.6 MB each
            assert tier.wait_visible(k)
        for i in range(40):  # far more than the pool holds at once: each one is released after use
            got = tier.get(ks[i % 3])
            assert got is not None and got.borrowed
            del got
        held = [tier.get(k).tensors["k"] for k in ks]  # keep only a tensor, drop the entries
        for i in range(3):
            assert tier.get(ks[i]) is not None
        for i, t in enumerate(held):
            assert torch.equal(t, entry(ks[i], 200, seed=i).tensors["k"])
        kept = tier.get(ks[0]).owned()
        assert not kept.borrowed and kept.tensors["k"].data_ptr() != held[0].data_ptr()
    finally:
        finishes(tier.close, 30)


def test_forged_entries_are_never_served(tmp_path, mac, key, entry, same):
    """Whoever can write the shared bytes but lacks the deployment's secret cannot get an entry served:
    a copied header over swapped tensors with a recomputed checksum fails the MAC, is dropped, counted
    and recomputed; a tier keyed by another deployment's secret reads nothing of ours."""
    disk = tmp_path / "disk"
    k = key("victim")
    tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=disk, mac_key=mac))
    try:
        tier.put(k, entry(k, 40, seed=1))
        assert tier.wait_visible(k)
        path = Path(tier._disk()._key_to_path(tier._key(k)))
    finally:
        tier.close()
    forged = encode_bytes(entry(k, 40, seed=99), bytes(32))  # valid layout and checksum, attacker's key
    assert decode(forged, k, bytes(32)).meta.digest == k.digest  # well-formed: only the MAC gives it away
    path.write_bytes(forged)
    tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=disk, mac_key=mac))
    try:
        assert tier.get(k) is None and tier.stats()["corrupt"] == 1 and not path.exists()
        tier.put(k, entry(k, 40, seed=1))  # recomputed
        assert tier.wait_visible(k) and same(tier.get(k), entry(k, 40, seed=1))
    finally:
        tier.close()
    other = LMCacheTier(LMCacheTierConfig("disk", disk_dir=disk, mac_key=bytes(range(1, 33))))
    try:
        assert other.get(k) is None and other.stats()["corrupt"] == 0  # another deployment names it otherwise
    finally:
        other.close()


def test_encrypted_entries_at_rest(tmp_path, redis_url, mac, key, entry, same):
    """With an encryption key the stored bytes hold no plaintext tensor or token id; they read back
    exactly through the same tier, and a tier without the key (or with another one) reads a miss, counted
    as corrupt, never the bytes as tensors."""
    enc = bytes(range(100, 132))
    k = key("secret-doc", "acme")
    e = entry(k, 48, seed=3)
    blob = encode_bytes(e, mac, enc)
    plain = encode_bytes(e, mac)
    k_bytes = e.tensors["k"].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
    ids_bytes = e.tensors["token_ids"].numpy().tobytes()
    assert k_bytes[:256] in plain and k_bytes[:256] not in blob and ids_bytes[8:64] not in blob
    assert same(decode(blob, k, mac, enc_key=enc), e) and not decode(blob, k, mac, enc_key=enc).borrowed
    for wrong in (None, bytes(32)):
        with pytest.raises(Exception, match="encrypted|decrypt"):
            decode(blob, k, mac, enc_key=wrong)
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(Exception, match="MAC"):
        decode(bytes(flipped), k, mac, enc_key=enc)
    tier = LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, mac_key=mac, enc_key=enc))
    other = LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, mac_key=mac))
    try:
        tier.put(k, e)
        assert tier.wait_visible(k)
        assert same(tier.get(k), e)
        assert other.get(k) is None and other.stats()["corrupt"] == 1  # no key: a miss, recomputed
    finally:
        tier.close()
        other.close()


def test_batched_calls_answer_as_single_ones_do_and_a_spent_deadline_asks_nothing(tiers, key, entry, same):
    """contains_many / get_many (the KV connector's one call per request or step) on every backend: the
    same answers as contains / get, hits and misses interleaved (a batch answers in the order asked), and a
    remote tier with no time left answers misses without a call."""
    from contextkit.kvstore.deadline import Deadline

    for name, tier in tiers.items():
        ks = [key(f"batch-{name}-{i}", tenant="tenant-b") for i in range(5)]
        made = {k: entry(k, 16, seed=i) for i, k in enumerate(ks) if i in (1, 2, 4)}
        for k, e in made.items():
            tier.put(k, e)
            assert tier.wait_visible(k), name
        assert tier.contains_many(ks, deadline=Deadline(5.0)) == [k in made for k in ks], name
        got = tier.get_many(ks, deadline=Deadline(5.0))
        assert all(same(g, made[k]) if k in made else g is None for g, k in zip(got, ks)), name
        if tier.cfg.kind == "remote":
            errors = tier.stats()["errors"]
            assert tier.contains_many(ks, deadline=Deadline(0.0)) == [False] * 5
            assert tier.get_many(ks, deadline=Deadline(0.0)) == [None] * 5
            assert tier.stats()["errors"] == errors and not tier.stats()["down"], name  # not asked, not failed


def test_prewarming_a_pool_touches_it_and_gives_it_back(tmp_path, key, entry, same, mac):
    """``prewarm`` (the connector's worker touches its pools at start) allocates the whole pool and frees
    it: a pool it leaked would have no room for the next write, which then would not be stored."""
    pool = 64 << 20
    tier = LMCacheTier(LMCacheTierConfig("disk", disk_dir=tmp_path / "disk", pool_bytes=pool, mac_key=mac))
    try:
        assert tier.prewarm(2 * pool) >= pool - (8 << 20)  # all of it, to the last whole chunk
        assert tier.prewarm(pool) >= pool - (8 << 20)  # twice: the first gave everything back
        k = key("prewarmed", tenant="tenant-w")
        e = entry(k, 16, seed=3)
        tier.put(k, e)
        assert tier.wait_visible(k) and same(tier.get(k), e)
        # an entry larger than the whole pool is refused and counted (LMCache's allocate would wait for room
        # that never comes: a connector's save thread stuck for good)
        big = key("larger-than-the-pool", tenant="tenant-w")
        errors = tier.stats()["errors"]
        tier.put(big, entry(big, 4096, seed=4))  # ~94 MB of KV
        assert tier.stats()["errors"] == errors + 1 and not tier.contains(big)
    finally:
        tier.close()
