"""``contextkit bench fleet``: routing over many vLLM servers by what each holds (issue 30).

Built so far: the simulation of the proxy's index at fleet scale (``--set servers=16,64,256``). The documents
trace (``bench ordering``'s, ``--n`` requests, default 200) is rendered by the planner as the proxy sends it,
under ``--set tenants=4`` tenants' salts. Each simulated server is fed ``BlockStored`` events for the
trace's prompts in an order of its own until its index holds ``--set blocks=10000`` blocks (the bound
forgets the oldest, as a server evicts), all into one ``FleetIndex``. Then every request is scored
against the whole fleet: its keys (``prompt_keys``) and one pass over the fleet map
(``FleetIndex.depth_groups``: the servers grouped by how much of the prompt they hold), beside the per-server
walk it replaces.

Rows, one per fleet size: the blocks held (all servers), distinct keys, the index's memory (tracemalloc:
the per-server indexes and the fleet map), memory per 100k blocks, ingest time per stored block, and the
scoring time per request (p50 / p99, µs). Summary: ``score_us_p99_at_max`` (target: under 100 µs at 256
servers) and ``index_mb_per_100k_blocks``. The two-server arms (round-robin, current routing, event-driven
routing, vllm-router, oracle) are not built yet.
"""

from __future__ import annotations

import dataclasses
import random
import time
import tracemalloc

from contextkit.bench.harness import BenchContext, BenchResult, Tick, median, percentile
from contextkit.bench.ordering import load_stream
from contextkit.core.errors import ConfigError


def _events(ids: list[int], salt: str, block: int) -> tuple[list[bytes], list[int]]:
    """A prompt's blocks as a server reports them: opaque hashes (here the index's own keys, one per
    content chain, as vLLM's are per server) and the tokens."""
    from contextkit.integrations.proxy.kv_index import prompt_keys

    keys = prompt_keys(ids, block_size=block, salt=salt)
    return keys, ids[: len(keys) * block]


def _fill(fleet_size: int, prompts: list[tuple[list[int], str]], *, block: int, blocks: int, seed: int):
    """``fleet_size`` servers' indexes in one fleet map, each fed the prompts in its own order until it
    holds ``blocks``; returns (fleet, servers, seconds per stored block, bytes allocated)."""
    from contextkit.integrations.proxy.kv_index import BlockIndex, FleetIndex

    rng = random.Random(seed)
    tracemalloc.start()
    fleet = FleetIndex()
    servers = [BlockIndex(block_size=block, max_blocks=blocks, fleet=fleet, server=s) for s in range(fleet_size)]
    stored, spent = 0, 0.0
    for index in servers:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            ids, salt = prompts[i]
            hashes, tokens = _events(ids, salt, block)
            extra = [(salt,)] + [None] * (len(hashes) - 1) if hashes else None
            t0 = time.perf_counter()
            index.stored(hashes, None, tokens, block, extra)
            spent += time.perf_counter() - t0
            stored += len(hashes)
            if len(index) >= blocks:
                break
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return fleet, servers, spent / max(1, stored), size


def _score(fleet, servers, prompts, block: int) -> tuple[list[float], list[float]]:
    """Per request: µs to key it and score the whole fleet in one pass, and µs for the per-server walk."""
    from contextkit.integrations.proxy.kv_index import prompt_keys

    one_pass, walk = [], []
    for ids, salt in prompts:
        t0 = time.perf_counter()
        keys = prompt_keys(ids, block_size=block, salt=salt)
        tk = time.perf_counter()
        groups = fleet.depth_groups(keys)  # deepest first: the router takes the least loaded of a group
        t1 = time.perf_counter()
        per = [s.held_prefix(keys) for s in servers]
        max(range(len(per)), key=per.__getitem__)
        t2 = time.perf_counter()
        one_pass.append(1e6 * (t1 - t0))
        walk.append(1e6 * ((tk - t0) + (t2 - t1)))
        assert {s: n for s, n in enumerate(per) if n} == fleet.held_prefixes(keys), "the map and the servers disagree"
        assert not groups or groups[0][0] == max(per)
    return one_pass, walk


def run(ctx: BenchContext, tick: Tick) -> BenchResult:
    from contextkit.bench.connector import _plan_all
    from contextkit.core.models import resolve_model_dir

    sizes = [int(x) for x in str(ctx.option("servers", "16,64,256")).split(",")]
    block, blocks = ctx.option("block_size", 32, int), ctx.option("blocks", 10_000, int)
    tenants = ctx.option("tenants", 4, int)
    if min(sizes) < 1 or blocks < 1 or tenants < 1:
        raise ConfigError("servers, blocks and tenants must be positive")
    live_rows, live = [], {}
    if ctx.option("live", 1, int):
        from contextkit.bench.fleet_live import run_live
        from contextkit.core.tokenizer import Tokenizer

        model_dir = resolve_model_dir(ctx.config.model, ctx.config.cache_dir)
        live_ctx = ctx if ctx.n is not None else dataclasses.replace(ctx, n=ctx.option("live_n", 48, int))
        live_rows, live = run_live(live_ctx, tick, model_dir, Tokenizer(model_dir))
    if ctx.n is None:
        ctx = dataclasses.replace(ctx, n=200)
    requests = load_stream(ctx, ctx.option("k", 8, int))
    plans = _plan_all(requests, resolve_model_dir(ctx.config.model, ctx.config.cache_dir), block)
    prompts = [(list(p.ids), f"tenant-{i % tenants}") for i, p in enumerate(plans)]
    tick(total=len(sizes))
    rows = list(live_rows)
    for n in sizes:
        fleet, servers, ingest_s, size = _fill(n, prompts, block=block, blocks=blocks, seed=ctx.seed)
        one_pass, walk = _score(fleet, servers, prompts, block)
        held = sum(len(s) for s in servers)
        rows.append({"servers": n, "blocks_held": held, "distinct_keys": len(fleet),
                     "index_mb": round(size / 2**20, 1), "mb_per_100k_blocks": round(size / 2**20 / held * 1e5, 2),
                     "ingest_us_per_block": round(1e6 * ingest_s, 2),
                     "score_us_p50": round(median(one_pass), 1), "score_us_p99": round(percentile(one_pass, 99), 1),
                     "per_server_walk_us_p50": round(median(walk), 1)})
        tick(f"{n} servers")
    summary = {"requests": len(prompts), "prompt_blocks_p50": median([len(i) // block for i, _ in prompts]),
               "score_us_p99_at_max": rows[-1]["score_us_p99"],
               "index_mb_per_100k_blocks": rows[-1]["mb_per_100k_blocks"], **live}
    config = {"block_size": block, "blocks_per_server": blocks, "tenants": tenants, "servers": sizes,
              "data": str(ctx.data) if ctx.data else "default"}
    return BenchResult("fleet", config, rows, summary)
