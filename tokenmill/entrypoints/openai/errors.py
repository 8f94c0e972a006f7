"""OpenAI-style error responses and the app's exception handlers.

Every error body is `{"error": {"message", "type", "param", "code"}}`; under
/api/ (the Ollama routes) it is Ollama's `{"error": "<message>"}`.
Mapping (what a client did -> status):

    malformed JSON, wrong field types (RequestValidationError)  -> 400
    a value out of range, prompt too long (ValueError)          -> 400
    unknown model name (ModelNotFoundError)                     -> 404
    missing / wrong API key (auth.py)                           -> 401
    body too large / not JSON (request_guard.py)                -> 413 / 415
    engine core process dead (EngineDeadError)                  -> 503
    anything else (a bug)                                       -> 500, logged;
                                                                   the connection and the server keep serving
                                                                   (UnexpectedErrorMiddleware)
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from tokenmill.frontend.core_client import EngineDeadError

logger = logging.getLogger(__name__)


class ModelNotFoundError(LookupError):
    """The request names a model this server does not serve (HTTP 404)."""

    def __init__(self, model: str, served: list[str]) -> None:
        super().__init__(f"The model `{model}` does not exist. This server serves: {', '.join(served)}.")
        self.model = model


def error_body(message: str, status: int, err_type: str | None = None, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error body as a dict.

    Args:
        message: a sentence for the user.
        status: HTTP status; picks the default `type`.
        err_type: OpenAI's error type (default from the status).
        param: the request field at fault, if known.
        code: a short machine-readable code (default: the status).
    """
    if err_type is None:
        err_type = {400: "invalid_request_error", 404: "invalid_request_error",
                    503: "service_unavailable"}.get(status, "internal_server_error")
    info = ErrorInfo(message=message, type=err_type, param=param, code=status if code is None else code)
    return ErrorResponse(error=info).model_dump()


def error_response(message: str, status: int, **kwargs: Any) -> JSONResponse:
    """A `JSONResponse` carrying `error_body(...)`."""
    return JSONResponse(error_body(message, status, **kwargs), status_code=status)


def _respond(request: Request, message: str, status: int, **kwargs: Any) -> JSONResponse:
    """`error_response`, or Ollama's `{"error": message}` for the Ollama routes (/api/*)."""
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": message}, status_code=status)
    return error_response(message, status, **kwargs)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence (and the field name) from pydantic's error list."""
    errors = exc.errors()
    if not errors:
        return "The request body is invalid.", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('msg', '')}.", None
    msg = first.get("msg", "invalid value")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ValueError) and first.get("type") == "value_error":
        # A validator's own sentence (pydantic prefixes "Value error, "): shown as written, naming its field.
        return str(cause), getattr(cause, "param", None) or param
    where = f" in `{param}`" if param else ""
    extra = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"Invalid request{where}: {msg.rstrip('.')}{extra}.", param


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on `app`."""

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _respond(request, message, HTTPStatus.BAD_REQUEST, param=param)

    @app.exception_handler(ValueError)
    async def _on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        # sampling_params.InvalidFieldError names its field; other ValueErrors name it in the message only.
        return _respond(request, str(exc) or "Invalid request.", HTTPStatus.BAD_REQUEST,
                        param=getattr(exc, "param", None))

    @app.exception_handler(ModelNotFoundError)
    async def _on_model_not_found(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        return _respond(request, str(exc), HTTPStatus.NOT_FOUND, param="model", code="model_not_found")

    @app.exception_handler(EngineDeadError)
    async def _on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _respond(request, exc.user_message(), HTTPStatus.SERVICE_UNAVAILABLE)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _respond(request, message, status, err_type="invalid_request_error" if status < 500 else None)


class UnexpectedErrorMiddleware:
    """An exception no handler took (a bug) -> a 500 error body, logged; the connection stays usable.

    Starlette's outermost error middleware answers 500 too, but then re-raises,
    and uvicorn closes the connection: a client's next request on that
    kept-alive connection was reset. This pure ASGI middleware (innermost of
    ours) answers and returns normally. When half a response already went out,
    only closing the connection can tell the client, so it re-raises.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unexpected error while serving %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            from tokenmill.entrypoints.openai.request_guard import send_json_error

            await send_json_error(scope, send, HTTPStatus.INTERNAL_SERVER_ERROR,
                                  f"Internal server error: {type(exc).__name__}: {exc}")
