"""``contextkit proxy``: a drop-in OpenAI-compatible proxy in front of one or more vLLM servers.

settings.py (flags, env, file), relay.py (upstream I/O, the raw pass-through relay), documents.py (chat
with documents: the planner, the upstream's Weaver, translation back to chat), app.py (the ASGI
application, metrics, access log, ``serve``).
"""

from contextkit.integrations.proxy.app import JsonLogFormatter, ProxyApp, create_app, serve
from contextkit.integrations.proxy.settings import ProxySettings, load_settings

__all__ = ["JsonLogFormatter", "ProxyApp", "ProxySettings", "create_app", "load_settings", "serve"]
