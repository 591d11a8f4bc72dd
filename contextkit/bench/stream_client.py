"""A small client for an OpenAI-compatible completions server (vLLM), built for measuring: it streams,
records time to first token, and returns the server's own count of prompt tokens served from its prefix
cache (``usage.prompt_tokens_details.cached_tokens``; vLLM needs ``--enable-prompt-tokens-details``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from contextkit.core.errors import UpstreamError


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
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        usage: dict = {}
        try:
            with self._http.stream("POST", self.url + "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise UpstreamError(f"{self.url} answered {resp.status_code}: {resp.text[:300]}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    for ch in obj.get("choices") or ():
                        if first is None:
                            first = time.perf_counter()
                        parts.append(ch.get("text") or "")
                    if obj.get("usage"):
                        usage = obj["usage"]
        except httpx.HTTPError as e:
            raise UpstreamError(f"request to {self.url} failed: {e}") from e
        end = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        return Completion(
            text="".join(parts),
            ttft_ms=((first or end) - t0) * 1e3,
            total_ms=(end - t0) * 1e3,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=details.get("cached_tokens"),
            completion_tokens=int(usage.get("completion_tokens", 0)),
        )

    def tokenize(self, text: str) -> list[int]:
        r = self._http.post(self.url + "/tokenize", json={"model": self.model, "prompt": text,
                                                          "add_special_tokens": False})
        if r.status_code != 200:
            raise UpstreamError(f"{self.url}/tokenize answered {r.status_code}: {r.text[:200]}")
        return list(r.json()["tokens"])

    def metrics(self) -> dict[str, float]:
        """The server's Prometheus counters, summed over label sets (name -> value)."""
        r = self._http.get(self.url + "/metrics")
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CompletionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
