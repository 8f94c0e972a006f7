"""ASGI middleware that counts HTTP responses by status code (`<prefix>http_responses_total{status}`).

It wraps every other middleware, so the 401s of the API-key check and the
413s of the body guard are counted too. A handler that raises before it
starts a response becomes Starlette's 500 outside this middleware; it is
counted here as 500 before the exception goes on.
"""

from __future__ import annotations

from typing import Any

from tokenmill.entrypoints.openai.metrics import ServerMetrics


class ResponseCounterMiddleware:
    """Counts the status of each HTTP response in `metrics` (WebSocket and lifespan pass through)."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.observe_http_response(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:  # a cancelled task (client gone) sent nothing and is not an error
            if not started:
                self.metrics.observe_http_response(500)
            raise
