"""The HTTP edge both servers share: request and answer shapes (``shapes``), body reading and checking
(``parse``), answers, events and errors (``answers``), the OpenAPI documents (``openapi``), the per-tenant
rate limit (``ratelimit``) and the request metrics (``metrics``)."""
