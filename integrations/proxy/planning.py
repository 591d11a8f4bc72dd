"""The proxy's CPU work off the event loop: thread pools that share their slots fairly between tenants.

Planning a documents request tokenizes every document (up to ``max_body_bytes`` of text) and searches
orders; parsing and serializing a large body takes ~0.3 s for 8 MiB on a 2-core machine. Done on the event
loop, every stream the proxy relays would stall meanwhile. ``Planning`` runs such calls on threads of its
own (not the loop's default executor, which also resolves upstream host names for aiohttp), at most
``limit`` at once; the app keeps two of them (``app.ProxyApp``): one for plannings and large bodies, one
for routing pass-through requests (rendering a prompt's block keys), so a small completion never waits
behind another tenant's 300-document planning.

Slots go to tenants fairly: when one frees, the waiting call of the owner with the fewest calls running
gets it (first come among equals). One tenant sending many large requests keeps the slots busy only while
nobody else waits; a single-tenant deployment still uses every slot.
"""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from contextkit.core.errors import ConfigError

# Plannings at once. Tokenizing is CPU-bound (the tokenizer's Rust core runs without the GIL), so more
# threads than the cores left over from the event loop only slow each other down, and each planning holds
# its request's tokens (~75 MB as Python ints for an 8 MiB body); two keep one core for the relay on a small
# machine and bound that memory; the others wait their turn without holding a thread.
MAX_PLANNINGS = 2


class Planning:
    """Runs calls on ``limit`` threads of its own, off the event loop, slots shared fairly by owner
    (module docstring). ``close()`` when the app stops."""

    def __init__(self, limit: int = MAX_PLANNINGS, *, name: str = "contextkit-plan"):
        if limit < 1:
            raise ConfigError(f"plannings at once must be >= 1, got {limit}")
        self.limit = limit
        self._pool = ThreadPoolExecutor(limit, thread_name_prefix=name)
        self.running = 0
        self._by_owner: Counter[str] = Counter()  # calls running, per owner
        self._waiting: list[tuple[str, asyncio.Future]] = []  # in arrival order, on the loop, cancellable

    async def run(self, fn, /, *args, owner: str = "", **kwargs):
        """``fn(*args, **kwargs)`` on a thread, once a slot is ``owner``'s (a tenant's name; "" for the
        proxy's own work)."""
        await self._acquire(owner)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        finally:
            self._release(owner)

    async def _acquire(self, owner: str) -> None:
        if self.running < self.limit and not self._waiting:
            self._take(owner)
            return
        entry = (owner, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]  # _release took the slot for this owner before waking it
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():  # granted, then cancelled: give the slot back
                self._release(owner)
            elif entry in self._waiting:
                self._waiting.remove(entry)
            raise

    def _take(self, owner: str) -> None:
        self.running += 1
        self._by_owner[owner] += 1

    def _release(self, owner: str) -> None:
        self.running -= 1
        self._by_owner[owner] -= 1
        if self._by_owner[owner] <= 0:
            del self._by_owner[owner]
        while self.running < self.limit and self._waiting:
            i = min(range(len(self._waiting)), key=lambda j: (self._by_owner[self._waiting[j][0]], j))
            owner_next, future = self._waiting.pop(i)
            if future.cancelled():
                continue
            self._take(owner_next)
            future.set_result(None)

    def waiting(self, owner: str | None = None) -> int:
        """Calls waiting for a slot (of ``owner``; None: of anyone)."""
        return sum(1 for o, _ in self._waiting if owner is None or o == owner)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
