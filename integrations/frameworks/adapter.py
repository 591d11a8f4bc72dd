"""What the LangChain and LlamaIndex adapters share: the client they run on, and ordering for reuse."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from contextkit.core.planner import content_id
from contextkit.core.tenant import Tenant
from contextkit.core.types import Doc, Evidence
from contextkit.ordering.weaver import Weaver
from contextkit.sdk.session import Client


def client_of(client: Any, base_url: str | None, api_key: str | None, model: str | None, timeout_s: float,
              who: str) -> Client:
    """``client`` checked, or an HTTP client for ``base_url`` (a contextkit serve or proxy root)."""
    if client is None:
        if not base_url:
            raise ValueError(f"{who} needs client=contextkit.connect(...) or base_url= (a contextkit serve or "
                             "proxy URL)")
        from contextkit.sdk.http import HTTPTransport

        return Client(HTTPTransport(base_url, api_key, model, timeout_s))
    if not isinstance(client, Client):
        raise ValueError(f"client must be a contextkit Client (contextkit.connect()), got {type(client).__name__}")
    return client


def reuse_order(evidence: Sequence[Evidence], weaver: Weaver, tenant: str,
                count_tokens: Callable[[str], int] | None) -> list[int]:
    """Indices into ``evidence`` in the order this tenant's served history reuses most (the Weaver's walk;
    recorded as served). A document given twice keeps its first place only. Lengths: ``count_tokens``, or
    characters / 4 (enough to rank; the model tokenizer's count gives exact blocks)."""
    docs, keep, seen = [], [], set()
    for i, ev in enumerate(evidence):
        did = ev.id or content_id(ev)
        if did in seen:
            continue
        seen.add(did)
        keep.append(i)
        docs.append(Doc(id=did, tokens=int(count_tokens(ev.text) if count_tokens else max(1, len(ev.text) // 4))))
    return [keep[i] for i in weaver.order(docs, Tenant.of(tenant)).order]
