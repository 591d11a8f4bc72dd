"""Server metrics on ``prometheus-client``: one registry per server, fixed label sets.

A route label is the route's template from a fixed list, never the raw path: a client sending
arbitrary paths can neither grow metric memory nor write lines into ``/metrics``.
"""

from __future__ import annotations

import hmac
import ipaddress

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from contextkit.core.errors import AuthenticationError, PermissionDeniedError

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/embeddings", "/tokenize", "/detokenize",
          "/version", "/health", "/metrics", "chat_documents", "/v1/chat/completions/batch", "/v1/responses",
          "/v1/messages", "/v1/messages/count_tokens")
OTHER = "other"
CONTENT_TYPE = CONTENT_TYPE_LATEST


def route_label(path: str) -> str:
    """``path`` if it is a known route template, else ``other``."""
    return path if path in ROUTES else OTHER


class ServerMetrics:
    """Requests by route and status, and time to first token, under ``prefix`` in a registry of its own."""

    def __init__(self, prefix: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(f"{prefix}_requests", "requests answered, by route and status",
                                ("route", "status"), registry=self.registry)
        self.ttft = Histogram(f"{prefix}_ttft_seconds", "time to the first token (or byte) of the answer",
                              buckets=TTFT_BUCKETS, registry=self.registry)

    def request(self, route: str, status: int) -> None:
        self.requests.labels(route_label(route), str(status)).inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def check_metrics_access(*, key: str | None, keyed: bool, authorization: bytes | None, client: str) -> None:
    """Who may read ``/metrics`` (it names every tenant's traffic and, on the proxy, the upstreams):

    - with a metrics ``key``, whoever sends ``Authorization: Bearer <key>``, from any address (401 else);
    - without one, on a server with API keys (``keyed``), nobody (403): behind a reverse proxy on the same
      host every client is a loopback peer, so the peer's address says nothing; the operator sets a key;
    - without one, on an open server (no API keys, which listens on loopback only), loopback peers.
    """
    if key:
        if not hmac.compare_digest(authorization or b"", f"Bearer {key}".encode()):
            raise AuthenticationError("/metrics needs the metrics key: send `Authorization: Bearer <metrics key>`")
        return
    if keyed:
        raise PermissionDeniedError("/metrics needs a metrics key on a server with API keys (behind a reverse "
                                    "proxy every client looks local); the operator sets one with --metrics-key "
                                    "and scrapes with `Authorization: Bearer <metrics key>`")
    if not _loopback(client):
        raise PermissionDeniedError("/metrics answers loopback clients only on a server without API keys")


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
