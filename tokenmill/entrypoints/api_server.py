"""vLLM's older simple HTTP API, which V100 guides still start: `python -m tokenmill.entrypoints.api_server`.

    POST /generate   {"prompt": str, "stream": bool, <SamplingParams fields>}
                     -> {"text": [prompt + completion, ...]}  (one entry per `n`)
                     stream: the same object after each step, cumulative, each followed by a NUL byte ("\\0")
                     (the engine sends DELTA outputs; the stream adds them up per completion)
    GET  /health     200 while the engine core runs, else 503

It takes every flag of `tokenmill serve` (the same engine, the same start-up
checks and shutdown); the API key, CORS and --middleware options apply here too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill.entrypoints.openai.api_server import _unless_disconnected
from tokenmill.entrypoints.openai.auth import APIKeyMiddleware, resolve_api_keys
from tokenmill.entrypoints.openai.errors import error_response, install_error_handlers
from tokenmill.entrypoints.openai.http_options import HTTPOptions, install_http_options
from tokenmill.entrypoints.openai.request_guard import DEFAULT_MAX_BODY_BYTES, BodyGuardMiddleware
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


def parse_generate_body(body: Any) -> tuple[str | list[int], bool, SamplingParams]:
    """Split a /generate body into (prompt, stream, SamplingParams).

    Raises:
        ValueError: the body is not an object, has no `prompt`, or has a field
            SamplingParams does not know or a bad value (the message names it).
    """
    if not isinstance(body, dict):
        raise ValueError("The request body must be a JSON object with a 'prompt' field.")
    fields = dict(body)
    prompt = fields.pop("prompt", None)
    if not isinstance(prompt, str) and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise ValueError("'prompt' is required: a string (or a list of token ids).")
    stream = fields.pop("stream", False)
    if not isinstance(stream, bool):
        raise ValueError(f"'stream' must be true or false, got {stream!r}.")
    try:
        params = SamplingParams(**fields)
    except TypeError as e:  # an unknown keyword: name it
        raise ValueError(f"Unknown /generate field: {e}. Use SamplingParams' field names (max_tokens, "
                         "temperature, top_p, n, stop, ...).") from e
    # A stream asks for each step's new text (DELTA) and adds it up itself (`_nul_separated`).
    params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return prompt, stream, params


def _texts(prompt: str | list[int], output: Any, texts: dict[int, str]) -> dict[str, list[str]]:
    """The /generate body: prompt + text of each completion (`texts`: index -> its text so far), by index."""
    prefix = prompt if isinstance(prompt, str) else (output.prompt or "")
    return {"text": [prefix + texts[i] for i in sorted(texts)]}


def build_generate_app(engine: Any, served_model_names: list[str], args: Any, opts: HTTPOptions) -> FastAPI:
    """The /generate + /health app over `engine` (an `AsyncLLM` or a test fake); `run_server` builder signature."""
    app = FastAPI(title="tokenmill (vLLM simple API)", **opts.fastapi_kwargs())
    install_error_handlers(app)
    app.add_middleware(BodyGuardMiddleware,
                       max_body_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES))
    app.state.api_keys = resolve_api_keys(getattr(args, "api_key", None))
    app.add_middleware(APIKeyMiddleware, api_keys=app.state.api_keys)
    install_http_options(app, opts)

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return error_response(f"The engine is not running: {exc}", 503)
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(raw_request: Request) -> Any:
        try:
            body = json.loads(await raw_request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"The request body is not valid JSON: {e}.") from e
        prompt, stream, params = parse_generate_body(body)
        # add_request validates now (a bad request is a 400 before any byte is sent), then queues.
        results = engine.add_request(f"generate-{uuid.uuid4().hex}", prompt, params)
        if stream:
            return StreamingResponse(_nul_separated(prompt, results), media_type="application/octet-stream")
        try:
            final = await _unless_disconnected(raw_request, _last(results))
        finally:
            results.close()  # aborts the request if it is still running (client gone)
        if final is None:
            return Response(status_code=499)
        return JSONResponse(_texts(prompt, final, {c.index: c.text for c in final.outputs}))

    return app


async def _last(results: Any) -> Any:
    final = None
    async for out in results:
        final = out
    return final


async def _nul_separated(prompt: str | list[int], results: Any) -> AsyncIterator[bytes]:
    """One JSON object per update, each followed by a NUL byte (vLLM's framing; clients split on b"\\0").

    `results` is the request's `OutputStream` of DELTA outputs (an output holds
    only the completions that progressed, and only their new text); closing it
    (also when the client disconnects and this generator is closed) aborts the request.
    """
    texts: dict[int, str] = {}  # completion index -> its text so far
    try:
        async for out in results:
            for comp in out.outputs:
                texts[comp.index] = texts.get(comp.index, "") + comp.text
            yield (json.dumps(_texts(prompt, out, texts)) + "\0").encode()
    finally:
        results.close()


def make_parser() -> argparse.ArgumentParser:
    """`python -m tokenmill.entrypoints.api_server`'s parser: every `tokenmill serve` flag."""
    from tokenmill.entrypoints.cli import add_serve_args

    parser = argparse.ArgumentParser(
        prog="python -m tokenmill.entrypoints.api_server",
        description="vLLM's simple API: POST /generate {prompt, stream, sampling fields} -> {text: [...]}; "
                    "GET /health. Same flags as tokenmill serve.")
    add_serve_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the flags and serve until SIGINT/SIGTERM. Returns the exit code (1 when start-up fails)."""
    from tokenmill.entrypoints.cli import cmd_serve

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    return cmd_serve(make_parser().parse_args(argv), build=build_generate_app)


if __name__ == "__main__":
    import os

    code = main()
    # As `tokenmill serve`: everything is shut down; skip the slow torch teardown at interpreter exit.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
