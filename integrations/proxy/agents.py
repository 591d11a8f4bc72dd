"""Parallel agents' fields through the proxy (``contextkit.keep``, ``contextkit.handles``): answered, not kept.

contextkit serve keeps a worker's KV under its response id and reads it where a synthesizer names the handle
(docs/servers.md, "Parallel agents over HTTP"). The proxy in front of vLLM keeps no such KV yet (issue 47's
vLLM path), and says so per request in the shape serve answers a miss with, so one client serves both: a
worker's ``kept`` is ``{"handle": null, "why": ...}``, and each named handle is read from its text
(``unknown``: never kept here; ``malformed`` and ``repeated`` as serve says them). The synthesizer carries its
workers' answers as text, so its answer is the text re-prefill's, as on serve when a handle misses.
Torch-free (the proxy's light install).
"""

from __future__ import annotations

from typing import Any

from contextkit.core.types import handle_name, is_handle
from contextkit.integrations.edge.parse import named_handles
from contextkit.integrations.edge.shapes import ChatBody

NOT_KEPT = ("this server keeps no KV for agents: the proxy in front of vLLM answers a synthesizer from its text "
            "(contextkit serve keeps a worker's KV under its response id)")


def agents_report(chat: ChatBody) -> dict[str, Any]:
    """The response's ``contextkit`` fields for a chat that keeps or names handles (none for one that does
    neither)."""
    out: dict[str, Any] = {}
    handles = named_handles(chat)
    if handles:
        reads: list[dict[str, Any]] = []
        for h in handles if not isinstance(handles, str) else ():  # "auto": none kept here, none found
            name = handle_name(h)
            if any(r["handle"] == name for r in reads):
                read = "repeated"
            else:
                read = "unknown" if is_handle(h) else "malformed"
            reads.append({"handle": name, "read": read, "tokens": 0, "read_tokens": 0})
        out["handles"] = reads
    if chat.contextkit is not None and chat.contextkit.keep:
        out["kept"] = {"handle": None, "why": NOT_KEPT}
    return out
