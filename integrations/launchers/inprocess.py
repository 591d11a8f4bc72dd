"""An ASGI app (the proxy, serve) under uvicorn in a daemon thread of this process, on a free loopback port.

For benches and tests that need the app's own state (the proxy's router, serve's kit) while it serves;
a deployment runs the CLI instead (``servers.proxy_process``).
"""

from __future__ import annotations

import threading
import time

from contextkit.core.errors import UpstreamError
from contextkit.integrations.launchers.process import free_port


class AppThread:
    """``with AppThread(app) as t:`` serves ``app`` at ``t.url`` until the block ends (``t.app`` is it)."""

    def __init__(self, app, startup_timeout_s: float = 60.0):
        import uvicorn

        self.port = free_port()
        self.app = app
        self.startup_timeout_s = startup_timeout_s
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> AppThread:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.server.started:  # uvicorn sets it once listening: nothing to wait on but the flag
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise UpstreamError(f"the app did not start serving within {self.startup_timeout_s:.0f} s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
