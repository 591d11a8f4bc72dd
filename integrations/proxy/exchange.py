"""One request's state inside the proxy, from arrival to the access log (``Exchange``).

Every step that answers or forwards the request writes here (the status sent, when it was forwarded and
when the upstream's first bytes came), and the access log and the ``x-contextkit-proxy-ms`` header read
it. The ids are the proxy's: ``request_id`` is the one vLLM keys the request by (never the client's),
``client_request_id`` the client's own ``X-Request-Id``, logged and echoed back to that client only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class Exchange:
    """One request's state (module docstring); times are ``time.perf_counter()`` seconds."""

    request_id: str  # sent upstream (``relay.upstream_request_id``)
    client_request_id: str | None = None
    t0: float = field(default_factory=time.perf_counter)
    status: int | None = None  # the status sent to the client (None: nothing sent yet)
    forwarded: float | None = None  # when the request went upstream
    upstream_first: float | None = None  # when the upstream's first bytes came
    documents: bool = False  # answered by the documents route

    def proxy_ms(self) -> float:
        """The proxy's own time: arrival to forwarding upstream (0 before it was forwarded)."""
        return (self.forwarded - self.t0) * 1e3 if self.forwarded is not None else 0.0
