"""``contextkit serve``: the OpenAI API on the built-in engine. ``app`` is the ASGI app over the facade
(``ContextKit``: ``create_serve_app`` builds a ``ServeApp``); ``engine_turns`` schedules requests onto the
engine's one thread (``EngineThreadScheduler``), token by token, the turn going to the tenant served least."""

from contextkit.integrations.serve.app import ServeApp, ServeLimits, create_serve_app

__all__ = ["ServeApp", "ServeLimits", "create_serve_app"]
