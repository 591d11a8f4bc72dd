"""``bench robustness``'s well-behaved side: the API keys of its tenants, the good tenants' requests, and
the good streams whose TTFT the bench compares before and during abuse.

Eight good tenants send documents chats of real multi-hop questions (each time in a new order) and plain
chats with a long per-tenant system prompt; an abuser and probe tenants (new in every run) get keys too.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp

from contextkit.bench.stream_client import stream_async
from contextkit.core.errors import ConfigError

GOOD = 8
ABUSER_KEY = "key-abuser-00"  # the one abuser tenant's key
DOCS = 6
SYSTEM = ("You answer questions for the {tenant} team. Keep answers short and cite the documents by title. "
          "Background the team keeps in every chat: {background}")


def api_keys(probes: int, run: str) -> dict[str, str]:
    """The API keys; probe tenants are new in every run (``run``): the deployment secret and a running vLLM
    outlive a run, and a probe tenant of an earlier run has a warm cache of its own."""
    keys = {f"key-good-{i:02d}": f"good{i}" for i in range(GOOD)}
    keys[ABUSER_KEY] = "abuser"
    keys.update({f"key-probe-{j:03d}": f"probe{j}-{run}" for j in range(probes)})
    return keys


def _documents(rec, rng: random.Random) -> list[dict]:
    docs = [{"title": p.title or "", "text": p.text} for p in rec.passages[:DOCS]]
    rng.shuffle(docs)
    return docs


class Workload:
    """The good tenants' requests: documents chats of the dev questions and plain chats with a long,
    per-tenant system prompt, cycled; the last ``held_out`` questions are kept for the forged-KV phase."""

    def __init__(self, records, seed: int, held_out: int, pool: int, model: str = "contextkit"):
        self.model = model
        if len(records) < held_out + GOOD:
            raise ConfigError(f"bench robustness needs >= {held_out + GOOD} questions, the data has {len(records)}")
        self.records, self.held = records[: min(pool, len(records) - held_out)], records[len(records) - held_out :]
        self.rng = random.Random(seed)
        self.background = {f"good{i}": " ".join(p.text for p in self.records[i].passages[:2]) for i in range(GOOD)}

    def plain(self, tenant: str) -> dict:
        return {"messages": [{"role": "system",
                              "content": SYSTEM.format(tenant=tenant, background=self.background[tenant])},
                             {"role": "user", "content": "What is the team's background about?"}]}

    def request(self, i: int, tenant: str) -> dict:
        if i % 4 == 3:
            return self.plain(tenant)
        rec = self.records[i % len(self.records)]
        return {"messages": [{"role": "user", "content": rec.question}], "documents": _documents(rec, self.rng)}


@dataclass
class GoodRun:
    """What the good streams saw: TTFTs, the longest gap between two chunks of each stream, the proxy's own
    time before forwarding each (its ``x-contextkit-proxy-ms``; none from serve), all in ms; errors, hangs."""

    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    proxy_ms: list[float] = field(default_factory=list)
    errors: int = 0
    hangs: int = 0


async def good_streams(url: str, work: Workload, streams: int, seconds: float, max_tokens: int, timeout_s: float,
                       rounds: int | None = None) -> GoodRun:
    """``streams`` clients, each a good tenant, sending streaming requests back to back for ``seconds``
    (or ``rounds`` requests each). A stream with no content is an error."""
    deadline = time.monotonic() + (seconds if rounds is None else 1e9)
    run = GoodRun()
    conn = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async def worker(w: int) -> None:
            tenant, i = f"good{w % GOOD}", w
            headers = {"authorization": f"Bearer key-good-{w % GOOD:02d}"}
            while time.monotonic() < deadline and (rounds is None or i < w + rounds * streams):
                body = {"model": work.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                        **work.request(i, tenant)}
                i += streams
                try:
                    s = await stream_async(session, url + "/v1/chat/completions", body, headers)
                except TimeoutError:
                    run.hangs += 1
                    continue
                except aiohttp.ClientError:
                    run.errors += 1
                    continue
                if s.status != 200:
                    run.errors += 1
                    await asyncio.sleep(0.5)
                elif s.first_ms is None:
                    run.errors += 1
                else:
                    run.ttft.append(s.first_ms)
                    if s.max_gap_ms is not None:
                        run.gaps.append(s.max_gap_ms)
                    if s.proxy_ms is not None:
                        run.proxy_ms.append(s.proxy_ms)

        await asyncio.gather(*(worker(w) for w in range(streams)))
    return run
