"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`.

Routes (docs/server.md has the details):
    GET  /health, /ping        200 while the engine core runs, else 503 (liveness)
    GET  /ready                200 once the engine has answered a request and runs (readiness.py)
    GET  /metrics              Prometheus text (metrics.py; vLLM's names)
    GET  /version
    GET  /v1/models            the served model name(s)
    POST /v1/completions       OpenAI completions (stream or not)
    POST /v1/chat/completions  OpenAI chat completions (stream or not)
    POST /tokenize, /detokenize
    GET  /stats                the latest SchedulerStats (JSON), for tests and debugging
    /api/*                     Ollama's API (entrypoints/ollama/)

Middleware, outermost first: X-Request-Id, API key (auth.py), body size and
content type (request_guard.py).

All requests share one engine: every handler only queues its requests and
awaits its own outputs, so the core batches whatever is in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from tokenmill.entrypoints.openai.auth import APIKeyMiddleware
from tokenmill.entrypoints.openai.errors import error_response, install_error_handlers
from tokenmill.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tokenmill.entrypoints.openai.readiness import readiness_route
from tokenmill.entrypoints.openai.request_guard import (
    DEFAULT_MAX_BODY_BYTES,
    BodyGuardMiddleware,
    RequestIdMiddleware,
)
from tokenmill.entrypoints.openai.response_counter import ResponseCounterMiddleware
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenmill.entrypoints.openai.serving_engine import OpenAIServing
from tokenmill.entrypoints.openai.serving_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    OpenAIServingTokenization,
    TokenizeRequest,
    TokenizeResponse,
)
from tokenmill.version import get_version

logger = logging.getLogger(__name__)

T = TypeVar("T")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (then returns None).

    Cancelling the work closes its `OutputStream`, which aborts the engine
    requests, so a vanished client's KV blocks are freed at once.
    """
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    logger.info("client disconnected; request aborted")
    return None


def _generation_route(serving: OpenAIServing, request_type: type[BaseModel], name: str) -> Callable[..., Any]:
    """The POST handler of a generation endpoint: `serving.start`, then SSE or the full response.

    FastAPI reads the body model from the handler's annotations, so the
    handler gets `request_type` there; `name` is the route's operation name.
    """

    async def route(req: Any, raw_request: Request) -> Any:
        response_id, model, sub = serving.start(req, raw_request)
        if req.stream:
            return StreamingResponse(serving.stream_response(req, response_id, model, sub),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            return await _unless_disconnected(raw_request, serving.full_response(req, response_id, model, sub))
        finally:
            sub.stream.close()

    route.__annotations__ = {"req": request_type, "raw_request": Request, "return": Any}
    route.__name__ = route.__qualname__ = name
    return route


def build_app(engine: Any, served_model_names: list[str], max_logprobs: int = 20,
              chat_template: str | None = None, *, api_keys: list[str] | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES, metrics_vllm_names: bool = False,
              max_n: int | None = None, **agent_kwargs: Any) -> FastAPI:
    """Create the FastAPI app serving `engine` (an `AsyncLLM` or a test fake).

    Args:
        engine: has `add_request`, `apply_chat_template`, `tokenizer`,
            `max_model_len`, `check_health()`, `get_scheduler_stats()`; when
            it has a `stats_observer` attribute, the app's `ServerMetrics` is
            put there.
        served_model_names: names clients may put in `model` (first = default).
        max_logprobs: largest logprobs/top_logprobs a request may ask for.
        chat_template: server-wide chat template override (file or Jinja text).
        api_keys: bearer keys required on protected routes (None/[]: open server).
        max_request_body_bytes: larger bodies get 413.
        metrics_vllm_names: also export /metrics under the `vllm:` prefix.
        max_n: largest `n` (default: the engine's max_num_seqs).
        agent_kwargs: enable_auto_tool_choice, tool_call_parser, reasoning_parser
            (see tool_parsers/agents.py).
    """
    from tokenmill.entrypoints.ollama.routes import build_ollama_router

    app = FastAPI(title="tokenmill", version=get_version())
    install_error_handlers(app)
    # add_middleware puts the last one outermost.
    app.add_middleware(BodyGuardMiddleware, max_body_bytes=max_request_body_bytes)
    app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys or []))
    app.add_middleware(RequestIdMiddleware)
    completion = OpenAIServingCompletion(engine, served_model_names, max_logprobs, max_n)
    chat = OpenAIServingChat(engine, served_model_names, max_logprobs, max_n, chat_template=chat_template,
                             **agent_kwargs)
    tokenization = OpenAIServingTokenization(engine, served_model_names, max_logprobs, max_n)
    metrics = ServerMetrics(served_model_names[0], vllm_names=metrics_vllm_names)
    if hasattr(engine, "stats_observer"):
        engine.stats_observer = metrics
    app.state.engine = engine
    app.state.metrics = metrics
    app.add_middleware(ResponseCounterMiddleware, metrics=metrics)  # outermost: counts 401s and 413s too
    app.add_api_route("/ready", readiness_route(engine), methods=["GET"])

    @app.get("/health")
    async def health() -> Any:
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"The engine is not running: {exc}", 503)
        return JSONResponse({"status": "ok"})

    app.add_api_route("/ping", health, methods=["GET"], include_in_schema=False)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": get_version()}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> ModelList:
        root = getattr(getattr(engine, "model_config", None), "model", None)
        cards = [ModelCard(id=name, root=root, max_model_len=engine.max_model_len) for name in served_model_names]
        return ModelList(data=cards)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = engine.get_scheduler_stats()
        return dataclasses.asdict(s) if s is not None else {}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        return tokenization.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        return tokenization.detokenize(req)

    app.add_api_route("/v1/completions", _generation_route(completion, CompletionRequest, "completions"),
                      methods=["POST"])
    app.add_api_route("/v1/chat/completions", _generation_route(chat, ChatCompletionRequest, "chat_completions"),
                      methods=["POST"])

    app.include_router(build_ollama_router(engine, served_model_names, _unless_disconnected))
    return app


def add_server_cli_args(group: Any) -> None:
    """Production flags of `tokenmill serve` (auth, limits, metrics, shutdown); see docs/server.md."""
    group.add_argument("--api-key", action="append", default=None,
                       help="Require 'Authorization: Bearer <key>' on /v1/*, /tokenize, /detokenize, /api/* "
                            "(repeat for several keys). Default: env TOKENMILL_API_KEY, else VLLM_API_KEY, else none.")
    group.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help=f"Larger request bodies get 413 (default {DEFAULT_MAX_BODY_BYTES}).")
    group.add_argument("--metrics-vllm-names", action="store_true", default=None,
                       help="Also export /metrics under vLLM's 'vllm:' prefix, for existing dashboards "
                            "(or env TOKENMILL_METRICS_VLLM_NAMES=1).")
    group.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="On SIGTERM/SIGINT: seconds in-flight requests get to finish before they are aborted "
                            "(default 10).")


def _graceful_server(config: Any) -> Any:
    """A uvicorn.Server whose SIGTERM/SIGINT ends `serve()` normally (exit code 0).

    uvicorn re-raises a caught signal after its graceful stop, which would kill
    the process by SIGTERM's default action before the engine is shut down.
    """
    import contextlib

    import uvicorn

    class GracefulServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if captured:
                    logger.info("stopping on signal %s", ", ".join(str(s) for s in captured))
                    captured.clear()

    return GracefulServer(config)


async def run_server(args: Any) -> int:
    """Start the engine core, then serve HTTP until SIGTERM/SIGINT. Returns the exit code.

    Shutdown: stop accepting connections, give in-flight requests
    `--shutdown-timeout` seconds to finish, abort what is left, stop the core.

    Raises:
        ValueError: bad engine arguments (the CLI prints it and exits 1).
        EngineStartupError: the core could not start (the CLI prints it and exits 1).
    """
    import uvicorn

    from tokenmill.config import EngineArgs
    from tokenmill.entrypoints.openai.auth import resolve_api_keys
    from tokenmill.entrypoints.openai.metrics import vllm_names_from_env
    from tokenmill.entrypoints.openai.tool_parsers.agents import ChatAgentConfig, agent_kwargs
    from tokenmill.frontend.async_llm import AsyncLLM

    engine_args = EngineArgs.from_cli_args(args)
    ChatAgentConfig(**agent_kwargs(args))  # bad tool/reasoning flags fail before the engine starts
    api_keys = resolve_api_keys(getattr(args, "api_key", None))
    shutdown_timeout = float(getattr(args, "shutdown_timeout", 10.0))
    if shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}.")
    vllm_names = getattr(args, "metrics_vllm_names", None)
    engine = await AsyncLLM.from_engine_args(engine_args, usage="server")
    try:
        mc = engine.model_config
        names = [mc.served_model_name or mc.model or "default"]
        app = build_app(engine, names, max_logprobs=mc.max_logprobs, chat_template=mc.chat_template,
                        api_keys=api_keys,
                        max_request_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES),
                        metrics_vllm_names=vllm_names if vllm_names is not None else vllm_names_from_env(),
                        **agent_kwargs(args))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5, access_log=not args.disable_uvicorn_access_log,
                                # A backstop only: abort_after_grace ends the streams first.
                                timeout_graceful_shutdown=shutdown_timeout + 2.0)
        server = _graceful_server(config)
        logger.info("serving %s on http://%s:%d%s", names[0], args.host, args.port,
                    " (API key required)" if api_keys else "")
        watcher = asyncio.ensure_future(_abort_after_grace(server, engine, shutdown_timeout))
        try:
            await server.serve()
        finally:
            watcher.cancel()
        engine.abort_all()
        return 0 if server.started else 1
    finally:
        engine.shutdown()


async def _abort_after_grace(server: Any, engine: Any, grace_s: float) -> None:
    """Once the server is stopping, give in-flight requests `grace_s` seconds, then abort the rest.

    Aborted requests end cleanly (a 503 body, or an error event then [DONE] in
    a stream), so uvicorn's own, later timeout never has to cancel a handler.
    """
    while not server.should_exit:
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and engine.num_requests_in_flight:
        await asyncio.sleep(0.1)
    left = engine.abort_all(f"The server is shutting down; the request was aborted after the {grace_s:g} s grace "
                            "period (--shutdown-timeout).")
    if left:
        logger.info("shutdown: aborted %d request(s) still running after %g s", left, grace_s)
