"""``bench robustness``'s leak checks. Probes: each probe tenant's first requests (documents the good tenants
sent; through the proxy also a good tenant's plain chat with its name as ``cache_salt``, and every
generation route, ``bench.boundary.route_probes``) must show nothing cached or reordered. Forged KV
(serve): a forger without the deployment secret writes the held-out questions' documents into the shared
tier under a good tenant's keys; the victim then asks them, and no span may hit a forged entry.
"""

from __future__ import annotations

import httpx

from contextkit.bench.boundary import route_probes
from contextkit.bench.harness import BenchContext
from contextkit.bench.tenants import DOCS, GOOD, Workload
from contextkit.core.errors import ConfigError


def _post(url: str, path: str, body: dict, key: str, timeout_s: float) -> tuple[int, dict]:
    r = httpx.post(url + path, json=body, headers={"authorization": f"Bearer {key}"}, timeout=timeout_s)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {}


def probe(url: str, server: str, work: Workload, probes: int, timeout_s: float) -> tuple[int, int, int, list[str]]:
    """(probe requests, leaks, route probes armed, what leaked): each probe tenant's first requests must show
    nothing cached; through the proxy also on every generation route (``bench.boundary``)."""
    leaks, sent, what = 0, 0, []
    for j in range(probes):
        key = f"key-probe-{j:03d}"
        body = {"model": work.model, "max_tokens": 2, "temperature": 0, **work.request(4 * j, f"good{j % GOOD}")}
        status, out = _post(url, "/v1/chat/completions", body, key, timeout_s)
        sent += 1
        ext = out.get("contextkit") or {}
        cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        seen = {"expected_cached_tokens": ext.get("expected_cached_tokens") or 0, "reordered": ext.get("reordered"),
                "span_hits": ext.get("span_hits") or 0, "cached_tokens": cached}
        if status != 200:
            what.append(f"probe {j}: status {status}")
        elif any(seen.values()):
            leaks += 1
            what.append(f"probe {j} (documents): {seen}")
        if server == "proxy":  # a good tenant's exact plain chat, with its name as the salt (the old salt)
            tenant = f"good{j % GOOD}"
            body = {"model": work.model, "max_tokens": 2, "temperature": 0, "cache_salt": tenant, **work.plain(tenant)}
            status, out = _post(url, "/v1/chat/completions", body, key, timeout_s)
            sent += 1
            cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if status == 200 and cached:
                leaks += 1
                what.append(f"probe {j} (plain chat, cache_salt={tenant}): cached_tokens {cached}")
    armed = 0
    if server == "proxy":
        n, route_leaks, armed, route_what = route_probes(
            lambda path, body, key: _post(url, path, body, key, timeout_s), work.model, probes, GOOD)
        sent, leaks, what = sent + n, leaks + route_leaks, what + route_what
    return sent, leaks, armed, what


def forge(ctx: BenchContext, redis_url: str, work: Workload, victim: str) -> None:
    """The forger: the held-out questions' documents compiled under ``victim``'s keys into the shared tier,
    authenticated with a key that is not the deployment's."""
    from contextkit import ContextKit, Evidence, ReuseOptions, SamplingParams
    from contextkit.core.config import ContextKitConfig, KVStoreConfig

    cfg = ContextKitConfig(model=ctx.config.model, cache_dir=ctx.config.cache_dir,
                           secret="a forger without the deployment secret: " + "f" * 32,
                           kvstore=KVStoreConfig(remote_url=redis_url))
    kit = ContextKit(cfg)
    try:
        for rec in work.held:
            docs = [Evidence(p.text, title=p.title) for p in rec.passages[:DOCS]]
            kit.generate(rec.question, docs, reuse=ReuseOptions(), params=SamplingParams(max_new_tokens=1),
                         tenant=victim)
    finally:
        kit.close()


def forged_served(url: str, work: Workload, timeout_s: float) -> tuple[int, int]:
    """(document span hits on forged entries, documents asked) as the victim asks the held-out questions."""
    served = asked = 0
    for rec in work.held:
        docs = [{"title": p.title or "", "text": p.text} for p in rec.passages[:DOCS]]
        body = {"model": work.model, "max_tokens": 2, "temperature": 0, "documents": docs,
                "messages": [{"role": "user", "content": rec.question}]}
        status, out = _post(url, "/v1/chat/completions", body, "key-good-00", timeout_s)
        if status != 200:
            raise ConfigError(f"the victim's request failed ({status}): {out}")
        ext = out["contextkit"]
        served += max(0, ext["span_hits"] - 1)  # the frame's own span may hit: it was compiled by serve itself
        asked += len(docs)
    return served, asked
