"""Cheap checks every HTTP request passes before a handler sees it (pure ASGI middleware).

`RequestIdMiddleware` (outermost): the request's id is its `X-Request-Id`
header when that is a sane token (1-128 printable ASCII characters), else a
fresh uuid4 hex. It is stored in `scope["state"]["request_id"]` (handlers
read `request.state.request_id` and build the response id from it, as vLLM
does) and returned in the response's `X-Request-Id` header, on errors too.

`BodyGuardMiddleware`: for requests with a body (POST/PUT/PATCH):

    Content-Type present and not JSON (application/json or */*+json)  -> 415
        (not under /api/: Ollama's clients and docs send JSON as a form)
    Content-Length above max_body_bytes                               -> 413
    a chunked body that grows above max_body_bytes                    -> 413
    JSON with a lone UTF-16 surrogate or nested absurdly deep         -> 400 (json_body_guard.py)
    a body still incomplete `body_timeout_s` after the headers        -> 408, connection closed

The body is read here (never more than the limit) and replayed to the app;
after it, `receive()` is the server's again, so handlers still see
`http.disconnect` when a client goes away.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from tokenmill.entrypoints.openai.json_body_guard import JSONBodyError, check_json_body

DEFAULT_MAX_BODY_BYTES = 4 * 2**20  # 4 MiB: far above any prompt that fits a context window


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value
    return None


def _valid_request_id(value: bytes | None) -> str | None:
    if value is None or not 0 < len(value) <= 128:
        return None
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() and " " not in text else None


async def send_json_error(scope: dict[str, Any], send: Any, status: int, message: str, param: str | None = None,
                          close: bool = False) -> None:
    """An error response in the route's style: OpenAI's body, or Ollama's `{"error": ...}` under /api/.

    `close`: ask the server to close the connection after it (`Connection: close`).
    """
    if scope.get("path", "").startswith("/api/"):
        body: dict[str, Any] = {"error": message}
    else:
        err_type = "invalid_request_error" if status < 500 else "service_unavailable" if status == 503 \
            else "internal_server_error"
        body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


class RequestIdMiddleware:
    """Gives every request an id and echoes it in `X-Request-Id` (see module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _valid_request_id(_header(scope, b"x-request-id")) or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


class BodyGuardMiddleware:
    """Content type and body size checks (see module docstring).

    Args:
        app: the ASGI app.
        max_body_bytes: largest request body accepted, in bytes.
    """

    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float | None = None,
                 ) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be positive, got {max_body_bytes}.")
        if body_timeout_s is not None and not body_timeout_s > 0:
            raise ValueError(f"--request-body-timeout must be positive seconds, got {body_timeout_s}.")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        content_type = _header(scope, b"content-type")
        if scope.get("path", "").startswith("/api/") or scope.get("path") == "/generate":
            # Ollama's and vLLM's simple API's (/generate) documented usage is
            # `curl -d '{...}'` (a form content type): those routes read the
            # body as JSON whatever the header says.
            headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        elif content_type is not None:
            media = content_type.split(b";")[0].strip().lower()
            if media != b"application/json" and not media.endswith(b"+json"):
                await send_json_error(scope, send, 415, f"Unsupported Content-Type {media.decode(errors='replace')!r}; "
                                      "send the body as JSON with 'Content-Type: application/json'.")
                return
        too_large = (f"The request body is larger than this server accepts ({self.max_body_bytes} bytes; "
                     "--max-request-body-bytes).")
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            await send_json_error(scope, send, 413, too_large)
            return
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = None if self.body_timeout_s is None else loop.time() + self.body_timeout_s
        try:
            while True:
                wait_s = None if deadline is None else max(deadline - loop.time(), 0.0)
                message = await asyncio.wait_for(receive(), wait_s)
                if message["type"] == "http.disconnect":
                    return  # the client left before sending its body
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    await send_json_error(scope, send, 413, too_large)
                    return
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        except asyncio.TimeoutError:
            await send_json_error(scope, send, 408, f"The request body did not arrive within {self.body_timeout_s:g} s "
                                  "(--request-body-timeout).", close=True)
            return
        try:
            check_json_body(b"".join(chunks))
        except JSONBodyError as e:
            await send_json_error(scope, send, 400, str(e), e.param)
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
