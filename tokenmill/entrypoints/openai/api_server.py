"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`.

Routes (docs/server.md has the details):
    GET  /health, /ping        200 while the engine core runs, else 503 (liveness)
    GET  /ready                200 once the engine has answered a request and runs (readiness.py)
    GET  /metrics              Prometheus text (metrics.py; vLLM's names)
    GET  /version
    GET  /v1/models            the served model name(s)
    POST /v1/completions       OpenAI completions (stream or not)
    POST /v1/chat/completions  OpenAI chat completions (stream or not)
    POST /v1/responses         OpenAI Responses (stream or not); GET /v1/responses/{id} a stored one
    POST /tokenize, /detokenize
    GET  /stats                the latest SchedulerStats (JSON), for tests and debugging
    /api/*                     Ollama's API (entrypoints/ollama/)
    POST /v1/embeddings, ...   501: vLLM routes not built yet (unbuilt_routes.py)

Middleware, outermost first: CORS and --middleware (http_options.py),
X-Request-Id, API key (auth.py), body size, content type and JSON sanity
(request_guard.py), unexpected errors -> 500 without dropping the connection
(errors.py).

`python -m tokenmill.entrypoints.openai.api_server [MODEL] [flags]` is
`tokenmill serve` (the module path older vLLM images start).

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
from tokenmill.entrypoints.openai.chat_template_guard import ChatTemplatePolicy, add_chat_template_cli_args
from tokenmill.entrypoints.openai.engine_watch import ENGINE_DEAD_EXIT_CODE, EngineWatch
from tokenmill.entrypoints.openai.errors import UnexpectedErrorMiddleware, error_response, install_error_handlers
from tokenmill.entrypoints.openai.http_options import HTTPOptions, install_http_options
from tokenmill.entrypoints.openai.limits import add_limit_cli_args, bounded_protocol
from tokenmill.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.entrypoints.openai.metrics import ServerMetrics, cache_config_info
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tokenmill.entrypoints.openai.protocol_responses import ResponsesRequest
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
from tokenmill.entrypoints.openai.serving_responses import OpenAIServingResponses
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
              max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES, request_body_timeout_s: float | None = None,
              metrics_vllm_names: bool = False, max_n: int | None = None, http_options: HTTPOptions | None = None,
              trust_request_chat_template: bool = False, sanitize_control_tokens: bool = False,
              **agent_kwargs: Any) -> FastAPI:
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
        request_body_timeout_s: a body not complete this long after its headers gets 408 (None: no deadline).
        metrics_vllm_names: also export /metrics under the `vllm:` prefix.
        max_n: largest `n` (default: the engine's max_num_seqs).
        http_options: CORS, --middleware, docs routes (default: none of them, docs on).
        trust_request_chat_template, sanitize_control_tokens: chat_template_guard.ChatTemplatePolicy.
        agent_kwargs: enable_auto_tool_choice, tool_call_parser, reasoning_parser
            (see tool_parsers/agents.py).
    """
    from tokenmill.entrypoints.ollama.routes import build_ollama_router
    from tokenmill.entrypoints.openai.unbuilt_routes import build_unbuilt_router

    http_options = http_options or HTTPOptions()
    app = FastAPI(title="tokenmill", version=get_version(), **http_options.fastapi_kwargs())
    install_error_handlers(app)
    # add_middleware puts the last one outermost.
    app.add_middleware(UnexpectedErrorMiddleware)
    app.add_middleware(BodyGuardMiddleware, max_body_bytes=max_request_body_bytes,
                       body_timeout_s=request_body_timeout_s)
    app.add_middleware(APIKeyMiddleware, api_keys=list(api_keys or []))
    app.add_middleware(RequestIdMiddleware)
    install_http_options(app, http_options)
    completion = OpenAIServingCompletion(engine, served_model_names, max_logprobs, max_n)
    policy = ChatTemplatePolicy(trust_request_chat_template, sanitize_control_tokens)
    app.state.template_policy = policy
    chat = OpenAIServingChat(engine, served_model_names, max_logprobs, max_n, chat_template=chat_template,
                             template_policy=policy, **agent_kwargs)
    responses = OpenAIServingResponses(chat)
    tokenization = OpenAIServingTokenization(engine, served_model_names, max_logprobs, max_n)
    tokenization.template_policy = policy
    engine_config = getattr(engine, "engine_config", None)  # test doubles may have none
    metrics = ServerMetrics(served_model_names[0], vllm_names=metrics_vllm_names,
                            cache_info=cache_config_info(engine_config.cache_config) if engine_config else None)
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

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw_request: Request) -> Any:
        skeleton, chat_req, sub, conversation = responses.start(req, raw_request)
        if req.stream:
            return StreamingResponse(responses.stream_response(req, skeleton, chat_req, sub, conversation),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            return await _unless_disconnected(
                raw_request, responses.full_response(req, skeleton, chat_req, sub, conversation))
        finally:
            sub.stream.close()

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Any:
        stored = responses.store.get(response_id)
        if stored is None:
            return error_response(f"No stored response has id {response_id!r} (responses are kept in memory, the "
                                  f"last {responses.store.max_stored} created with store=true).", 404)
        return stored.response

    app.include_router(build_ollama_router(engine, served_model_names, _unless_disconnected, policy))
    app.include_router(build_unbuilt_router())
    return app


def add_server_cli_args(group: Any) -> None:
    """Production flags of `tokenmill serve` (auth, limits, metrics, shutdown, HTTP options); see docs/server.md."""
    from tokenmill.entrypoints.openai.http_options import add_http_cli_args

    add_http_cli_args(group)
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
    add_chat_template_cli_args(group)
    add_limit_cli_args(group)


def _graceful_server(config: Any) -> Any:
    """A uvicorn.Server whose SIGTERM/SIGINT ends `serve()` normally (exit code 0).

    A second signal during the grace period ends the grace at once: what is
    still in flight is aborted (`_abort_after_grace`), as when it runs out.
    A third SIGINT is uvicorn's force quit (aborted streams may be cut off).

    uvicorn re-raises a caught signal after its graceful stop, which would kill
    the process by SIGTERM's default action before the engine is shut down.
    """
    import contextlib

    import uvicorn

    class GracefulServer(uvicorn.Server):
        # Set by a second SIGTERM/SIGINT: `_abort_after_grace` ends the grace period at once.
        grace_cut_short = False

        def handle_exit(self, sig, frame) -> None:  # type: ignore[override]
            """First SIGTERM/SIGINT: stop (uvicorn's own). Second: end the grace period only. A later SIGINT is
            uvicorn's force quit, which stops waiting for connections, so aborted streams may be cut off."""
            if self.should_exit and not self.grace_cut_short:
                # Not passed on: uvicorn turns a second SIGINT into force_exit, and serve() would then return
                # before the aborted requests have written their 503 / error event and [DONE].
                self.grace_cut_short = True
                return
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[override]
            with super().capture_signals():
                yield
                captured = getattr(self, "_captured_signals", None)
                if captured:
                    logger.info("stopping on signal %s", ", ".join(str(s) for s in captured))
                    captured.clear()

    return GracefulServer(config)


async def run_server(args: Any, build: Callable[[Any, list[str], Any, HTTPOptions], FastAPI] | None = None) -> int:
    """Start the engine core, then serve HTTP until SIGTERM/SIGINT. Returns the exit code.

    Before the engine starts: vLLM flags that are ignored here are logged and
    not-built ones refused (config/vllm_flags.py), and a bad port, missing
    file or unreadable model path fails (http_options.check_before_start).
    Shutdown: stop accepting connections, give in-flight requests
    `--shutdown-timeout` seconds to finish, abort what is left, stop the core.
    A dead engine core stops the server too, with exit code
    ENGINE_DEAD_EXIT_CODE (engine_watch.py).

    Args:
        args: the parsed `tokenmill serve` flags.
        build: `build(engine, served_model_names, args, http_options) -> app`;
            default the OpenAI app (the legacy /generate server passes its own).

    Raises:
        ValueError: bad engine arguments (the CLI prints it and exits 1).
        EngineStartupError: the core could not start (the CLI prints it and exits 1).
    """
    import uvicorn

    from tokenmill.config import EngineArgs
    from tokenmill.entrypoints.openai.auth import resolve_api_keys
    from tokenmill.entrypoints.openai.http_options import check_before_start, http_options_from_args
    from tokenmill.entrypoints.openai.stats_logger import log_stats_periodically
    from tokenmill.entrypoints.openai.tool_parsers.agents import ChatAgentConfig, agent_kwargs
    from tokenmill.config.vllm_flags import check_compat_flags
    from tokenmill.engine.gc_heap import freeze_gc_heap
    from tokenmill.frontend.async_llm import AsyncLLM

    check_compat_flags(vars(args))
    check_before_start(args)
    opts = http_options_from_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    ChatAgentConfig(**agent_kwargs(args))  # bad tool/reasoning flags fail before the engine starts
    resolve_api_keys(getattr(args, "api_key", None))  # so do empty API keys
    shutdown_timeout = float(getattr(args, "shutdown_timeout", 10.0))
    if shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}.")
    # Bad limits fail before the engine starts.
    protocol = bounded_protocol(opts.header_timeout_s, opts.limit_concurrency)
    if not opts.body_timeout_s > 0:
        raise ValueError(f"--request-body-timeout must be positive seconds, got {opts.body_timeout_s}.")
    engine = await AsyncLLM.from_engine_args(engine_args, usage="server")
    engine.log_requests, engine.max_log_len = opts.log_requests, opts.max_log_len
    try:
        mc = engine.model_config
        names = list(mc.served_model_names) or [mc.served_model_name or mc.model or "default"]
        app = (build or build_openai_app)(engine, names, args, opts)
        config = uvicorn.Config(app, **opts.uvicorn_kwargs(), timeout_keep_alive=5, http=protocol,
                                # A backstop only: abort_after_grace ends the streams first.
                                timeout_graceful_shutdown=shutdown_timeout + 2.0)
        server = _graceful_server(config)
        keyed = bool(getattr(app.state, "api_keys", None))
        engine_watch = EngineWatch(server, engine)
        tasks = [asyncio.ensure_future(_abort_after_grace(server, engine, shutdown_timeout)),
                 asyncio.ensure_future(_log_when_bound(server, names[0], opts, keyed)),
                 asyncio.ensure_future(engine_watch.run())]
        if opts.log_stats:
            tasks.append(asyncio.ensure_future(log_stats_periodically(engine)))
        # The start-up heap (torch, transformers, the tokenizer, the app: ~240k objects) out of the cyclic
        # GC: a full collection walking it stalled every stream for ~0.15 s (benchmarks/frontend_bench.py).
        freeze_gc_heap()
        try:
            await server.serve()
        finally:
            for task in tasks:
                task.cancel()
        engine.abort_all()
        if engine_watch.engine_died:
            return ENGINE_DEAD_EXIT_CODE
        return 0 if server.started else 1
    finally:
        engine.shutdown()


def build_openai_app(engine: Any, names: list[str], args: Any, opts: HTTPOptions) -> FastAPI:
    """The OpenAI app for `tokenmill serve`'s parsed flags (`run_server`'s default builder)."""
    from tokenmill.entrypoints.openai.auth import resolve_api_keys
    from tokenmill.entrypoints.openai.metrics import vllm_names_from_env
    from tokenmill.entrypoints.openai.tool_parsers.agents import agent_kwargs

    mc = engine.model_config
    api_keys = resolve_api_keys(getattr(args, "api_key", None))
    vllm_names = getattr(args, "metrics_vllm_names", None)
    app = build_app(engine, names, max_logprobs=mc.max_logprobs, chat_template=mc.chat_template, api_keys=api_keys,
                    max_request_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES),
                    request_body_timeout_s=opts.body_timeout_s,
                    metrics_vllm_names=vllm_names if vllm_names is not None else vllm_names_from_env(),
                    http_options=opts,
                    trust_request_chat_template=bool(getattr(args, "trust_request_chat_template", False)),
                    sanitize_control_tokens=bool(getattr(args, "sanitize_control_tokens", False)),
                    **agent_kwargs(args))
    app.state.api_keys = api_keys
    return app


async def _log_when_bound(server: Any, name: str, opts: HTTPOptions, keyed: bool) -> None:
    """Log "serving NAME on URL" once uvicorn has bound its socket (never before: a bad port fails first)."""
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.05)
    port = opts.port
    for s in getattr(server, "servers", []):
        for sock in getattr(s, "sockets", None) or []:
            port = sock.getsockname()[1]
    scheme = "https" if opts.ssl.get("ssl_certfile") else "http"
    logger.info("serving %s on %s://%s:%d%s%s", name, scheme, opts.host, port, opts.root_path,
                " (API key required)" if keyed else "")


async def _abort_after_grace(server: Any, engine: Any, grace_s: float) -> None:
    """Once the server is stopping, give in-flight requests `grace_s` seconds, then abort the rest.

    A second stop signal (`server.grace_cut_short`) ends the grace early.
    Aborted requests end cleanly (a 503 body, or an error event then [DONE] in
    a stream), so uvicorn's own, later timeout never has to cancel a handler.
    """
    while not server.should_exit:
        await asyncio.sleep(0.1)
    deadline = time.monotonic() + grace_s
    while (time.monotonic() < deadline and engine.num_requests_in_flight
           and not getattr(server, "grace_cut_short", False)):
        await asyncio.sleep(0.1)
    cut_short = getattr(server, "grace_cut_short", False) and time.monotonic() < deadline
    why = ": a second stop signal ended the" if cut_short else f" after the {grace_s:g} s"
    left = engine.abort_all(f"The server is shutting down; the request was aborted{why} grace period "
                            "(--shutdown-timeout).")
    if left:
        logger.info("shutdown: aborted %d request(s) still running %s", left,
                    "on a second stop signal" if cut_short else f"after {grace_s:g} s")


if __name__ == "__main__":
    import sys

    from tokenmill.entrypoints.cli import main

    # vLLM's `python -m vllm.entrypoints.openai.api_server --model M ...` == `tokenmill serve --model M ...`.
    sys.argv = [sys.argv[0], "serve", *sys.argv[1:]]
    sys.exit(main())
