"""The proxy's upstream pool: health and load (where a request goes is ``routing.Router``'s choice).

Each upstream (a vLLM server) has its own ``Weaver``: the tree of evidence sequences it has served is a
model of what its prefix cache holds, which orders documents requests for it and places them when the
server publishes no KV events. A background task checks ``/health``: an upstream that answers it with an
error or refuses the connection is taken out of rotation at once, one that is only slow to answer after three
checks in a row (a CPU server busy with a long prefill answers late but serves), and each is put back when
it answers again; three failed requests in a row take it out too, unless it is the last one in rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from contextkit.core.errors import ConfigError
from contextkit.ordering.weaver import Weaver


@dataclass
class Upstream:
    url: str
    weaver: Weaver  # a model of what this server's prefix cache holds (the planner's orderer)
    name: str = ""  # what clients see ("upstream-0"): the URL is the operator's, never in a response
    healthy: bool = True
    inflight: int = 0
    requests: int = 0
    consecutive_failures: int = 0
    slow_checks: int = 0  # /health checks in a row that timed out


class UpstreamPool:
    def __init__(self, urls: Sequence[str], block_size: int):
        if not urls:
            raise ConfigError("the proxy needs at least one --upstream URL (a vLLM server)")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"upstream URLs must start with http:// or https://, got {bad}")
        for i, u in enumerate(urls):
            _check_no_secret(i, u)
        self.upstreams = [Upstream(u.rstrip("/"), Weaver(block_size=block_size), name=f"upstream-{i}")
                          for i, u in enumerate(urls)]

    def healthy(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.healthy]

    def least_loaded(self) -> Upstream | None:
        pool = self.healthy()
        return min(pool, key=lambda u: (u.inflight, u.requests)) if pool else None

    @contextlib.contextmanager
    def lease(self, u: Upstream) -> Iterator[Upstream]:
        """Count a request to ``u`` in flight for as long as the block runs (it cannot leak: the count
        goes back whatever ends the block)."""
        u.inflight += 1
        u.requests += 1
        try:
            yield u
        finally:
            u.inflight -= 1

    async def check(self, client: aiohttp.ClientSession, timeout_s: float = 2.0, slow_limit: int = 3) -> None:
        """Check every upstream's ``/health``: an error answer or a refused connection takes it out of
        rotation, ``slow_limit`` timeouts in a row do too, a 200 puts it back."""

        async def one(u: Upstream) -> None:
            try:
                async with client.get(u.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    ok = r.status == 200
            except TimeoutError:  # before ClientError: aiohttp's ServerTimeoutError is both
                u.slow_checks += 1
                if u.slow_checks >= slow_limit:
                    u.healthy = False
                return
            except aiohttp.ClientError:
                ok = False
            u.healthy, u.slow_checks = ok, 0
            if ok:
                u.consecutive_failures = 0

        await asyncio.gather(*(one(u) for u in self.upstreams))

    async def watch(self, client: aiohttp.ClientSession, interval_s: float) -> None:
        """Check every ``interval_s`` seconds, the first after one interval: the caller checked at start
        (a second check right away would race whatever the start's check told it)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.check(client)

    def mark_failed(self, u: Upstream, threshold: int = 3) -> None:
        """A request to ``u`` failed. ``threshold`` failures in a row take it out of rotation until its
        ``/health`` answers again, unless it is the last one in rotation (then the health check decides:
        one dropped connection under load must not turn into a burst of 503s)."""
        u.consecutive_failures += 1
        others = [x for x in self.upstreams if x.healthy and x is not u]
        if u.consecutive_failures >= threshold and others:
            u.healthy = False


def _check_no_secret(index: int, url: str) -> None:
    """An upstream URL is logged, labels ``/metrics`` and keys span compiles: it must carry no credential.
    The message names the upstream by its place, never echoing what it holds."""
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"upstream #{index + 1} has credentials in its URL, which is logged and shown on "
                          "/metrics: give the URL without user:password@ and the server's key with "
                          "--upstream-api-key (vLLM's --api-key)")
    if parts.query or parts.fragment:
        raise ConfigError(f"upstream #{index + 1} has a query or fragment in its URL: give the server's base "
                          "URL (http://HOST:PORT, optionally a path) and its key with --upstream-api-key")
