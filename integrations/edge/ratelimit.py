"""A request rate per tenant, checked before a request's body is read.

Both servers answer a request over its tenant's rate with 429 (``Retry-After`` says when the next one
fits) right after the API key is checked: the body is neither read nor parsed, so a client that sends as
fast as it can costs the server an HTTP exchange per request, not a JSON parse, a tokenization or an
engine turn. The queue bounds of ``serve`` limit how much one tenant has waiting; this limits how often
it may ask.

A token bucket per tenant (the tenant of the key, so a key's client-chosen sub-tenants share its bucket):
``rate_per_s`` tokens a second up to ``burst``; a request takes one. Written here rather than taken from
a library because it is twenty lines on the event loop's own clock with no lock (every check runs on
the event loop), and the libraries on PyPI (``limits``, ``slowapi``) bring storage backends and
decorators for a check that must happen inside our own ASGI handlers.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from cachetools import LRUCache

from contextkit.core.errors import ConfigError, RateLimitError
from contextkit.core.tenancy import Tenant


@dataclass(frozen=True, slots=True)
class RateLimit:
    """Requests a tenant may send: ``rate_per_s`` on average, ``burst`` at once (0: no limit).

    Attributes:
        rate_per_s: requests per second a tenant's bucket refills with; 0 turns the limit off.
        burst: the bucket's size (requests a quiet tenant may send at once); 0 means twice the rate.
        max_tenants: buckets kept (least recently used dropped first; a dropped bucket starts full).
    """

    rate_per_s: float = 0.0
    burst: int = 0
    max_tenants: int = 4096

    def __post_init__(self) -> None:
        if self.rate_per_s < 0 or self.burst < 0 or self.max_tenants < 1:
            raise ConfigError("rate limit: rate_per_s and burst must be >= 0 (0: off) and max_tenants >= 1")
        if self.rate_per_s and self.size < 1:
            raise ConfigError(f"rate limit: a burst of {self.size:g} cannot hold one request; set burst >= 1")

    @property
    def on(self) -> bool:
        return self.rate_per_s > 0

    @property
    def size(self) -> float:
        return float(self.burst) if self.burst else 2.0 * self.rate_per_s

    @classmethod
    def parse(cls, text: str | None) -> RateLimit:
        """``"RATE"`` or ``"RATE/BURST"`` (requests per second per tenant, e.g. ``"10/20"``); empty or
        ``"0"``: no limit."""
        if not text or text.strip() in ("0", "off", "none"):
            return cls()
        rate, _, burst = text.strip().partition("/")
        try:
            return cls(float(rate), int(burst) if burst else 0)
        except ValueError:
            raise ConfigError(f"rate limit {text!r}: write RATE or RATE/BURST, e.g. 10 or 10/20 (requests per "
                              "second per tenant, and how many at once)") from None


class RateLimiter:
    """Token buckets per tenant under one ``RateLimit``; ``check`` raises ``RateLimitError`` (429)."""

    def __init__(self, limit: RateLimit, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self._clock = clock
        # tenant -> (tokens, when); past max_tenants the least recently checked bucket is dropped
        self._buckets: LRUCache[str, tuple[float, float]] = LRUCache(limit.max_tenants)
        self.refused = 0

    def check(self, tenant: Tenant) -> None:
        """Take one request from ``tenant``'s bucket, or refuse it with the seconds until one fits."""
        lim = self.limit
        if not lim.on:
            return
        now = self._clock()
        tokens, when = self._buckets.pop(tenant.name, (lim.size, now))
        tokens = min(lim.size, tokens + (now - when) * lim.rate_per_s)
        if tokens < 1.0:
            self._buckets[tenant.name] = (tokens, now)
            self.refused += 1
            wait = (1.0 - tokens) / lim.rate_per_s
            raise RateLimitError(
                f"too many requests: this API key's tenant may send {lim.rate_per_s:g} requests/s "
                f"({lim.size:g} at once); retry after {wait:.2f} s or ask the operator for a higher limit",
                retry_after_s=wait)
        self._buckets[tenant.name] = (tokens - 1.0, now)
