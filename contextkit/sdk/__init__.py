"""The SDK entry point: ``connect()`` returns a ``Client`` on the built-in engine (no URL) or over HTTP.

    import contextkit
    client = contextkit.connect()                                   # in process, the embedded default model
    client = contextkit.connect("http://localhost:8000", api_key=KEY)    # contextkit serve / proxy

Both transports take the same calls and return the same ``Answer`` (``contextkit.sdk.shapes``). The
in-process one runs the KV path: documents and skills are position-free spans reused at the default
policy unless a call says otherwise; it alone can ``fork`` worker branches and ``join`` their KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from contextkit.core.config import ContextKitConfig
from contextkit.core.errors import ConfigError
from contextkit.core.extras import LOCAL_EXTRA, missing
from contextkit.sdk.session import Client

if TYPE_CHECKING:
    from contextkit.kit import ContextKit



def connect(url: str | None = None, api_key: str | None = None, *, config: ContextKitConfig | None = None,
            kit: ContextKit | None = None, model: str | None = None, timeout_s: float = 120.0) -> Client:
    """A client: over HTTP to ``url`` (a ``contextkit serve`` or ``contextkit proxy`` root) with
    ``api_key``, or, without a URL, in process on ``kit`` (or a new ``ContextKit(config)``)."""
    if url is None:
        if lacking := missing():  # a light install (the client extra) has no engine
            raise ConfigError(f"connect() without a URL runs the built-in engine, which this install lacks "
                              f"({', '.join(lacking)} missing): {LOCAL_EXTRA}, or pass the URL of a "
                              "contextkit serve or proxy")
        from contextkit.kit import ContextKit
        from contextkit.sdk.local import LocalTransport

        return Client(LocalTransport(kit or ContextKit(config)))
    from contextkit.sdk.http import HTTPTransport

    return Client(HTTPTransport(url, api_key, model, timeout_s))
