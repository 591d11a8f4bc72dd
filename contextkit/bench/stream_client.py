"""The benches' one client for OpenAI-compatible servers (vLLM, ``contextkit proxy``, ``contextkit serve``),
built for measuring.

One definition of time to first token, whatever the route or transport: request sent -> the first
streamed chunk whose choice carries generated content (``text`` on ``/v1/completions``, ``delta.content``
on chat), stamped as its line is read, before it is parsed. ``SSEReader`` holds that rule; ``stream``
(httpx, sequential benches) and ``stream_async`` (aiohttp, the concurrent load of ``bench proxy`` and
``bench robustness``) feed it. ``CompletionClient`` is ``/v1/completions`` with token-id prompts, and
returns the server's own count of prompt tokens served from its prefix cache
(``usage.prompt_tokens_details.cached_tokens``; vLLM needs ``--enable-prompt-tokens-details``).
``scrape_metrics`` reads a server's Prometheus text with ``prometheus_client``'s parser.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from contextkit.core.errors import UpstreamError

if TYPE_CHECKING:
    import aiohttp


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed answer as the client saw it."""

    status: int
    first_ms: float | None  # request sent -> first content delta; None: none came
    total_ms: float  # request sent -> end of the stream (or of the error answer)
    text: str = ""
    usage: Mapping[str, Any] = field(default_factory=dict)  # the last ``usage`` seen
    contextkit: Mapping[str, Any] = field(default_factory=dict)  # the last ``contextkit`` extension seen
    error: str = ""  # an error answer's body, first 300 characters
    max_gap_ms: float | None = None  # the longest wait between two content deltas (None: fewer than two)
    proxy_ms: float | None = None  # the proxy's own time before forwarding (its x-contextkit-proxy-ms header)

    @property
    def ttft_ms(self) -> float:
        """TTFT, or the whole time when no content came (a stream that ended without a token)."""
        return self.total_ms if self.first_ms is None else self.first_ms

    @property
    def cached_tokens(self) -> int | None:
        return (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")


class SSEReader:
    """Reads one answer's server-sent events and stamps the first content delta (the TTFT rule)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.first: float | None = None
        self.last: float | None = None  # the latest content delta
        self.max_gap: float | None = None
        self.parts: list[str] = []
        self.usage: dict = {}
        self.extension: dict = {}
        self.done = False

    def feed(self, line: str | bytes) -> None:
        now = time.perf_counter()  # as the line arrives: parsing it is the client's time, not the server's
        if isinstance(line, bytes):
            line = line.decode("utf-8", "replace")
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        obj = json.loads(data)
        for ch in obj.get("choices") or ():
            text = ch["text"] if "text" in ch else (ch.get("delta") or {}).get("content")
            if text is None:
                continue
            if self.first is None:
                self.first = now
            if self.last is not None and self.last != now:
                self.max_gap = max(self.max_gap or 0.0, now - self.last)
            self.last = now
            self.parts.append(text)
        if obj.get("usage"):
            self.usage = obj["usage"]
        if obj.get("contextkit"):
            self.extension = obj["contextkit"]

    def result(self, status: int, proxy_ms: float | None = None) -> Streamed:
        end = time.perf_counter()
        return Streamed(status, None if self.first is None else (self.first - self.t0) * 1e3, (end - self.t0) * 1e3,
                        "".join(self.parts), self.usage, self.extension,
                        max_gap_ms=None if self.max_gap is None else self.max_gap * 1e3, proxy_ms=proxy_ms)


def _error(status: int, t0: float, body: str) -> Streamed:
    return Streamed(status, None, (time.perf_counter() - t0) * 1e3, error=body[:300])


def stream(http: httpx.Client, url: str, body: dict, headers: Mapping[str, str] | None = None, *,
           where: str | None = None) -> Streamed:
    """POST ``body`` to the endpoint ``url`` and read the stream; ``UpstreamError`` on an error status or a
    failed request (naming ``where``, default ``url``)."""
    where = where or url
    t0 = time.perf_counter()
    try:
        with http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                resp.read()
                raise UpstreamError(f"{where} answered {resp.status_code}: {resp.text[:300]}")
            reader = SSEReader(t0)
            for line in resp.iter_lines():
                reader.feed(line)
                if reader.done:
                    break
    except httpx.HTTPError as e:
        raise UpstreamError(f"request to {where} failed: {e}") from e
    return reader.result(200)


async def stream_async(session: aiohttp.ClientSession, url: str, body: dict,
                       headers: Mapping[str, str] | None = None) -> Streamed:
    """``stream`` on aiohttp, for many concurrent streams: an error status is returned (``status``,
    ``error``), not raised; a transport error or timeout is raised as aiohttp raises it."""
    t0 = time.perf_counter()
    async with session.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            return _error(r.status, t0, (await r.read()).decode("utf-8", "replace"))
        reader = SSEReader(t0)
        async for line in r.content:
            reader.feed(line)
            if reader.done:
                break
        proxy_ms = r.headers.get("x-contextkit-proxy-ms")
        return reader.result(200, float(proxy_ms) if proxy_ms else None)


def scrape_metrics(url: str, *, labels: Mapping[str, str] | None = None, http: httpx.Client | None = None,
                   timeout_s: float = 10.0, key: str | None = None) -> dict[str, float]:
    """``GET {url}/metrics``: each sample's value (by its name as written: ``..._total``, ``..._bucket``)
    summed over the label sets that hold every pair of ``labels``. ``key``: the server's metrics key (a
    server with API keys answers ``/metrics`` only with it)."""
    headers = {"authorization": f"Bearer {key}"} if key else None
    r = (http.get(url.rstrip("/") + "/metrics", headers=headers) if http is not None
         else httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=timeout_s))
    r.raise_for_status()
    text = r.text
    want = dict(labels or {})
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if all(s.labels.get(k) == v for k, v in want.items()):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    ttft_ms: float  # request sent -> first streamed token
    total_ms: float
    prompt_tokens: int
    cached_tokens: int | None  # None when the server does not report it
    completion_tokens: int


class CompletionClient:
    """Streaming ``/v1/completions`` with token-id prompts (so segment boundaries stay as tokenized)."""

    def __init__(self, url: str, model: str, timeout_s: float = 120.0):
        self.url = url.rstrip("/")
        self.model = model
        self._http = httpx.Client(timeout=timeout_s)

    def complete(
        self,
        prompt: Sequence[int] | str,
        max_tokens: int = 32,
        cache_salt: str | None = None,
        stop: Sequence[str] = (),
    ) -> Completion:
        """Greedy completion; raises ``UpstreamError`` with the server's message on an error status."""
        body: dict = {
            "model": self.model, "prompt": list(prompt) if not isinstance(prompt, str) else prompt,
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
        if stop:
            body["stop"] = list(stop)
        if cache_salt:
            body["cache_salt"] = cache_salt
        s = stream(self._http, self.url + "/v1/completions", body, where=self.url)
        return Completion(
            text=s.text,
            ttft_ms=s.ttft_ms,
            total_ms=s.total_ms,
            prompt_tokens=int(s.usage.get("prompt_tokens", 0)),
            cached_tokens=s.cached_tokens,
            completion_tokens=int(s.usage.get("completion_tokens", 0)),
        )

    def tokenize(self, text: str) -> list[int]:
        r = self._http.post(self.url + "/tokenize", json={"model": self.model, "prompt": text,
                                                          "add_special_tokens": False})
        if r.status_code != 200:
            raise UpstreamError(f"{self.url}/tokenize answered {r.status_code}: {r.text[:200]}")
        return list(r.json()["tokens"])

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus samples, summed over label sets (name -> value)."""
        return scrape_metrics(self.url, http=self._http)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CompletionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
