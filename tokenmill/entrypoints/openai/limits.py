"""Connection-level limits uvicorn lacks: a deadline for request headers, and a cap on open connections.

uvicorn's `timeout_keep_alive` only covers the idle time between requests; a
client that opens a socket and sends half a header (or nothing) holds it for
as long as it likes (h11 has no header timeout). `BoundedH11Protocol` arms a
timer whenever the connection waits for a request's headers:

    connect / data after a response -> timer armed (header_timeout_s)
    the headers are complete        -> timer disarmed (the body has its own
                                       deadline: request_guard.py)
    timer fires                     -> 408 with a JSON body, connection closed

and answers 503 (a JSON body, `Connection: close`) to a request that arrives
while more than `limit_concurrency` connections are open or requests are in
flight; uvicorn's own `limit_concurrency` answers in plain text. Idle
keep-alive connections are closed by uvicorn after `timeout_keep_alive`.
"""

from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.entrypoints.openai.request_guard import send_json_error

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_LIMIT_CONCURRENCY = 1024

_TIMEOUT_BODY = json.dumps({"error": {
    "message": "The request headers did not arrive in time (--request-header-timeout); the connection is closed.",
    "type": "invalid_request_error", "param": None, "code": 408}}).encode()
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a JSON 503 past the connection cap.

    Configure by subclassing (`bounded_protocol`): uvicorn instantiates the class itself.
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    # Not `limit_concurrency`: uvicorn's __init__ sets that instance attribute from its Config (its own check).
    connection_limit: int | None = DEFAULT_LIMIT_CONCURRENCY

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: Any = None
        if self.connection_limit is not None:
            self.app = self._capped(self.app, self.connection_limit)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # the first bytes of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers did not arrive within %g s",
                             self.header_timeout_s)
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()

    def _capped(self, app: Any, limit: int) -> Any:
        connections, tasks = self.connections, self.tasks

        async def capped_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            # This request's connection and task are already counted.
            if scope["type"] == "http" and (len(connections) > limit or len(tasks) > limit):
                await send_json_error(scope, send, 503, f"The server is at its limit of {limit} open connections "
                                      "or requests in flight (--limit-concurrency); retry shortly.", close=True)
                return
            await app(scope, receive, send)

        return capped_app


def bounded_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                     limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY) -> type[BoundedH11Protocol]:
    """A `BoundedH11Protocol` class with these limits, for `uvicorn.Config(http=...)`.

    Raises:
        ValueError: a non-positive timeout or limit.
    """
    if not header_timeout_s > 0:
        raise ValueError(f"--request-header-timeout must be positive seconds, got {header_timeout_s}.")
    if limit_concurrency is not None and limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be at least 1, got {limit_concurrency}.")
    return type("BoundedH11Protocol", (BoundedH11Protocol,),
                {"header_timeout_s": header_timeout_s, "connection_limit": limit_concurrency})


def add_limit_cli_args(group: Any) -> None:
    """`--request-header-timeout`, `--request-body-timeout`, `--limit-concurrency` (docs/server.md)."""
    group.add_argument("--request-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       help="Seconds a connection may take to send a request's headers (also the next request's on "
                            f"a kept-alive connection); then 408 and close (default {DEFAULT_HEADER_TIMEOUT_S:g}).")
    group.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       help="Seconds a request may take to send its body once its headers arrived; then 408 "
                            f"(default {DEFAULT_BODY_TIMEOUT_S:g}).")
    group.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY,
                       help="Most open connections / requests in flight (uvicorn's name); past it a request gets "
                            f"503 with a JSON body (default {DEFAULT_LIMIT_CONCURRENCY}).")
