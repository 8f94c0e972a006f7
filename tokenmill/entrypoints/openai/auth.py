"""API-key authentication for the HTTP server (pure ASGI middleware).

Keys come from `--api-key` (repeatable) or, when no flag is given, the env
variables `TOKENMILL_API_KEY` or `VLLM_API_KEY` (vLLM's name, so an existing
deployment's secret works unchanged). With no key configured every route is
open.

With a key, every route needs `Authorization: Bearer <key>` except the ones
monitoring and discovery tools call without credentials:

    open:       /health, /ready, /metrics, /version, /ping, /api/version, /openapi.json, /docs, /redoc
    protected:  everything else: /v1/*, /tokenize, /detokenize, /stats, /api/* (Ollama)

Protecting by default means a route added later is never left open by
accident. Keys are compared with `hmac.compare_digest` against every
configured key (no early exit), so the response time does not reveal how
much of a guess was right. A refused request gets 401 with an OpenAI error
body (Ollama routes: Ollama's `{"error": ...}`) and `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from tokenmill import envs

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/ping", "/api/version", "/openapi.json",
                        "/docs", "/docs/oauth2-redirect", "/redoc"})


def resolve_api_keys(flag_keys: list[str] | None, environ: dict[str, str] | None = None) -> list[str]:
    """The configured keys: the flag's if given, else TOKENMILL_API_KEY, else VLLM_API_KEY ([] = no auth).

    Raises:
        ValueError: a configured key is empty or only whitespace.
    """
    if flag_keys:
        keys = list(flag_keys)
    else:
        value = envs.api_key(environ)
        keys = [value] if value is not None else []
    for key in keys:
        if not key.strip():
            raise ValueError("An API key must not be empty; pass a real secret to --api-key / TOKENMILL_API_KEY.")
    return keys


def is_open_path(path: str) -> bool:
    """True for the routes that never need a key (health checks, metrics scrapes, docs)."""
    return path in OPEN_PATHS


def _bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                return token.strip()
            return None
    return None


class APIKeyMiddleware:
    """Refuses requests without a valid bearer key on protected routes (see module docstring).

    Args:
        app: the ASGI app to protect.
        api_keys: accepted keys; empty -> the middleware lets everything through.
    """

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    def is_authorized(self, token: bytes | None) -> bool:
        """Constant-time check of `token` against every key."""
        if token is None:
            token = b""
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(token, key)
        return ok

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or not self.keys or scope.get("method") == "OPTIONS"
                or is_open_path(scope.get("path", ""))):
            await self.app(scope, receive, send)
            return
        if self.is_authorized(_bearer_token(scope.get("headers", []))):
            await self.app(scope, receive, send)
            return
        message = "Missing or invalid API key: send it as 'Authorization: Bearer <key>'."
        if scope.get("path", "").startswith("/api/"):
            body: dict[str, Any] = {"error": message}
        else:
            body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                              "code": "invalid_api_key"}}
        raw = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": raw})
