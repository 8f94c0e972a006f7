"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over `AsyncLLM`.

Routes:
    GET  /health               200 while the engine core runs, else 503
    GET  /v1/models            the served model name(s)
    POST /v1/completions       OpenAI completions (stream or not)
    POST /v1/chat/completions  OpenAI chat completions (stream or not)
    GET  /stats                the latest SchedulerStats (JSON), for tests and debugging
    GET  /version

All requests share one engine: every handler only queues its requests and
awaits its own outputs, so the core batches whatever is in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.entrypoints.openai.errors import error_response, install_error_handlers
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tokenmill.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion
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


def build_app(engine: Any, served_model_names: list[str], max_logprobs: int = 20,
              chat_template: str | None = None, **agent_kwargs: Any) -> FastAPI:
    """Create the FastAPI app serving `engine` (an `AsyncLLM` or a test fake).

    Args:
        engine: has `add_request`, `apply_chat_template`, `tokenizer`,
            `max_model_len`, `check_health()`, `get_scheduler_stats()`.
        served_model_names: names clients may put in `model` (first = default).
        max_logprobs: largest logprobs/top_logprobs a request may ask for.
        chat_template: server-wide chat template override (file or Jinja text).
        agent_kwargs: enable_auto_tool_choice, tool_call_parser, reasoning_parser
            (see tool_parsers/agents.py).
    """
    app = FastAPI(title="tokenmill", version=get_version())
    install_error_handlers(app)
    completion = OpenAIServingCompletion(engine, served_model_names, max_logprobs)
    chat = OpenAIServingChat(engine, served_model_names, max_logprobs, chat_template=chat_template, **agent_kwargs)
    app.state.engine = engine

    @app.get("/health")
    async def health() -> Any:
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"The engine is not running: {exc}", 503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": get_version()}

    @app.get("/v1/models")
    async def models() -> ModelList:
        root = getattr(getattr(engine, "model_config", None), "model", None)
        cards = [ModelCard(id=name, root=root, max_model_len=engine.max_model_len) for name in served_model_names]
        return ModelList(data=cards)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        s = engine.get_scheduler_stats()
        return dataclasses.asdict(s) if s is not None else {}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw_request: Request) -> Any:
        response_id, model, sub = completion.start(req)
        if req.stream:
            return StreamingResponse(completion.stream_response(req, response_id, model, sub),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            return await _unless_disconnected(raw_request, completion.full_response(req, response_id, model, sub))
        finally:
            sub.stream.close()

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw_request: Request) -> Any:
        response_id, model, sub = chat.start(req)
        if req.stream:
            return StreamingResponse(chat.stream_response(req, response_id, model, sub),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            return await _unless_disconnected(raw_request, chat.full_response(req, response_id, model, sub))
        finally:
            sub.stream.close()

    return app


async def run_server(args: Any) -> int:
    """Start the engine core, then serve HTTP until interrupted. Returns the exit code.

    Raises:
        ValueError: bad engine arguments (the CLI prints it and exits 1).
        EngineStartupError: the core could not start (the CLI prints it and exits 1).
    """
    import uvicorn

    from tokenmill.config import EngineArgs
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.entrypoints.openai.tool_parsers.agents import ChatAgentConfig, agent_kwargs

    engine_args = EngineArgs.from_cli_args(args)
    ChatAgentConfig(**agent_kwargs(args))  # bad tool/reasoning flags fail before the engine starts
    engine = await AsyncLLM.from_engine_args(engine_args, usage="server")
    try:
        mc = engine.model_config
        names = [mc.served_model_name or mc.model or "default"]
        app = build_app(engine, names, max_logprobs=mc.max_logprobs, chat_template=mc.chat_template,
                        **agent_kwargs(args))
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                timeout_keep_alive=5, access_log=not args.disable_uvicorn_access_log)
        server = uvicorn.Server(config)
        logger.info("serving %s on http://%s:%d", names[0], args.host, args.port)
        await server.serve()
        return 0 if server.started else 1
    finally:
        engine.shutdown()
