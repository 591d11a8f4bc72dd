"""What the LangChain and LlamaIndex adapters share: the client they run on, and ordering for reuse."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

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


class Reordering(BaseModel):
    """The settings and the Weaver of a framework's reorder step (LangChain's compressor, LlamaIndex's
    postprocessor, each a pydantic model of its framework that also derives from this one).

    ``block_size``: the engine's KV block size (vLLM: 16 on GPU, 32 on CPU). ``tenant``: whose served history
    the order follows. ``count_tokens``: a document's length in tokens (default: characters / 4, enough to
    rank; pass the model tokenizer's for exact blocks)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    block_size: int = 16
    tenant: str = ""
    count_tokens: Callable[[str], int] | None = None
    _weaver: Weaver = PrivateAttr()

    def model_post_init(self, __context: Any) -> None:
        self._weaver = Weaver(block_size=self.block_size)
        Tenant.of(self.tenant)  # checked once, here

    def reordered(self, evidence: Sequence[Evidence]) -> list[int]:
        return reuse_order(evidence, self._weaver, self.tenant, self.count_tokens)


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
