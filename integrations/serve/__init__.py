"""``contextkit serve``: the OpenAI API on the built-in engine. ``app`` is the ASGI app over the facade
(``ContextKit``); ``engine_turns`` shares the one engine thread between requests, token by token, the turn
going to the tenant served least."""

from contextkit.integrations.serve.app import ServeLimits, create_serve_app

__all__ = ["ServeLimits", "create_serve_app"]
