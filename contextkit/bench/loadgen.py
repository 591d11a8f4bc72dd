"""``bench proxy``'s load generator for the overhead phase: each request sent directly and through the proxy
back to back, over raw keep-alive connections that stamp the first event as its bytes arrive, in a
process of its own at a lower CPU priority.

Its TTFT is ``stream_client``'s rule applied to raw bytes: the first SSE event with a choice (on vLLM
and the proxy every such chunk carries ``text`` or ``delta.content``), stamped in ``data_received``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from urllib.parse import urlsplit


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator that sends prebuilt streaming requests and
    stamps the first SSE event with choices in ``data_received``, i.e. as soon as the event loop sees the
    bytes: a few microseconds per chunk, so 64 streams of the client itself add next to nothing to the
    TTFT it measures (aiohttp's line reader added ~2 ms at 64 streams on a shared core)."""

    END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked response (a data chunk ends with "\n\n\r\n")

    def __init__(self):
        self.transport = None
        self.waiter: asyncio.Future | None = None
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        _, conn = await asyncio.get_running_loop().create_connection(cls, host, port)
        return conn

    def connection_made(self, transport) -> None:
        self.transport = transport

    async def request(self, raw: bytes, timeout_s: float = 600.0) -> tuple[float, bool]:
        """(ms to the first event with choices, ok) of one streaming request; a timeout is an error."""
        self.waiter = asyncio.get_running_loop().create_future()
        self.t0, self.first, self.status, self.tail = time.perf_counter(), None, None, b""
        if self.closed:
            return 0.0, False
        self.transport.write(raw)
        try:
            return await asyncio.wait_for(self.waiter, timeout_s)
        except TimeoutError:
            self.transport.close()
            return timeout_s * 1e3, False

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        seen = self.tail + data
        if self.status is None:
            self.status = seen[9:12]
        if self.first is None and b'"choices":[{' in seen:
            self.first = now
        self.tail = seen[-64:]
        if self.status != b"200" or seen.endswith(self.END):
            if self.status != b"200":  # an error answer: give up on this connection
                self.transport.close()
            if self.waiter and not self.waiter.done():
                self.waiter.set_result((((self.first or now) - self.t0) * 1e3, self.status == b"200"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.waiter and not self.waiter.done():
            self.waiter.set_result(((time.perf_counter() - self.t0) * 1e3, False))


def _request(host: str, body: dict, rid: str) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"x-request-id: {rid}\r\ncontent-length: {len(data)}\r\n\r\n").encode() + data


async def _overhead(a: str, b: str, model: str, questions: list[str], conc: int, max_tokens: int):
    """Each request sent to ``a`` and to ``b`` back to back, alternating which goes first, each with its
    own ``cache_salt`` so neither warms the other's cache. Returns the (a, b) TTFT pairs, errors, and b's
    TTFT by request id."""
    work = list(enumerate(questions))
    pairs, errors, by_id = [], 0, {}
    hosts = [urlsplit(u) for u in (a, b)]

    async def worker() -> None:
        nonlocal errors
        conns = [await _Conn.open(h.hostname, h.port) for h in hosts]
        try:
            while work:
                i, q = work.pop()
                body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True}
                order = (0, 1) if i % 2 else (1, 0)
                rids = [uuid.uuid4().hex, uuid.uuid4().hex]
                raws = [_request(hosts[k].netloc, {**body, "cache_salt": uuid.uuid4().hex}, rids[k]) for k in (0, 1)]
                got = [None, None]
                for k in order:
                    for attempt in (0, 1):
                        # the server closes a keep-alive connection idle for a few seconds (uvicorn: 5 s;
                        # the other arm's request can take that long at 64 streams): reopen before
                        # sending, and retry once when it closed as we sent, before any byte came back
                        if conns[k].closed:
                            conns[k] = await _Conn.open(hosts[k].hostname, hosts[k].port)
                        got[k] = await conns[k].request(raws[k])
                        if got[k][1] or conns[k].status is not None:
                            break
                if got[1][1]:
                    by_id[rids[1]] = got[1][0]
                if got[0][1] and got[1][1]:
                    pairs.append((got[0][0], got[1][0]))
                else:
                    errors += 1
        finally:
            for c in conns:
                c.transport.close()

    await asyncio.gather(*(worker() for _ in range(conc)))
    return pairs, errors, by_id


def _overhead_run(*args):
    """``_overhead`` in the load generator's own process (see ``LoadGenerator``)."""
    return asyncio.run(_overhead(*args))


class LoadGenerator:
    """The client side of the overhead phase in a process of its own at a lower CPU priority (``nice``):
    sharing the proxy's core, a client at equal priority takes turns with the proxy and its own
    scheduling delays land in the figure (p99 12-15 ms in runs where the proxy's own time stayed at
    0.09 ms); niced, the proxy runs first whenever both are ready, so what is left is the proxy's."""

    def __init__(self, nice: int):
        import concurrent.futures
        import multiprocessing

        self.pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=os.nice, initargs=(nice,))

    def overhead(self, *args):
        return self.pool.submit(_overhead_run, *args).result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)
