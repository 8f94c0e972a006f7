"""The `tokenmill` command: `tokenmill serve [MODEL] ...`, `tokenmill --version`, more subcommands.

Adding a subcommand: list its module in `SUBCOMMAND_MODULES` under the
command name. The module either has `register(subparsers)` (adds its parser
and sets `func=<callable(args) -> int>` as a default) or a `main(argv) -> int`
that parses its own arguments (`tokenmill NAME ARGS...` calls
`main([ARGS...])`). Modules not present yet are skipped, so the list can
name commands still being written.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from tokenmill import envs
from tokenmill.version import get_version

# command name -> (module, one-line help); see the module docstring.
SUBCOMMAND_MODULES = {
    "env": ("tokenmill.entrypoints.env", "Show the environment: versions, devices, defaults."),
    "bench": ("tokenmill.benchmarks.cli", "Benchmarks: serve, throughput, latency, plot."),
}


# A missing module -> the extra of pyproject.toml that installs it.
_EXTRA_OF_MODULE = {
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "pydantic": "serve", "zmq": "serve",
    "msgspec": "serve", "prometheus_client": "serve", "xgrammar": "serve",
    "aiohttp": "bench", "matplotlib": "bench", "gguf": "gguf", "ray": "ray",
}


def missing_extra_message(exc: ModuleNotFoundError, command: str) -> str | None:
    """The sentence for a module of an optional extra that is not installed, or None for any other module.

    Example: "tokenmill bench needs the 'bench' extra (aiohttp is not installed): ..."
    """
    top = (exc.name or "").partition(".")[0]
    extra = _EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (f"tokenmill {command} needs the '{extra}' extra ({top} is not installed): in the tokenmill checkout run "
            f"pip install -e '.[{extra}]' (make serve installs serve and gguf).")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `serve` (the OpenAI-compatible server) with every engine flag.

    Raises:
        ModuleNotFoundError: the serve extra is missing (before `serve` is added).
    """
    import tokenmill.entrypoints.openai.api_server  # noqa: F401 - fastapi etc.: fail before the parser exists
    import tokenmill.entrypoints.openai.tool_parsers.agents  # noqa: F401

    parser = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible HTTP server.",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics) and Ollama's (/api/chat, /api/generate, ...). Defaults marked 'CPU ... / GPU ...' depend on the device found.",
    )
    add_serve_args(parser)
    parser.set_defaults(func=cmd_serve)
    return parser


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of `tokenmill serve` (also the legacy /generate server's): model, server, engine, vLLM compat."""
    from tokenmill.config import EngineArgs
    from tokenmill.entrypoints.openai.api_server import add_server_cli_args
    from tokenmill.entrypoints.openai.tool_parsers.agents import add_agent_cli_args
    from tokenmill.config.vllm_flags import add_compat_cli_args

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="A local folder, a .gguf file, a Hugging Face repo id, or 'modelscope:<id>' "
                             "(default: the bundled SmolLM2-135M-Instruct).")
    parser.add_argument("--model", default=None, help="Same as the positional MODEL (vLLM spelling).")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=envs.default_host(),
                   help="Address to listen on. The default only accepts local clients; use 0.0.0.0 to expose "
                        "the server to the network (set --api-key then). Default env TOKENMILL_HOST, else "
                        "127.0.0.1.")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on, 0-65535 (default 8000).")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every HTTP request.")
    add_server_cli_args(g)  # --api-key, --max-request-body-bytes, --metrics-vllm-names, --shutdown-timeout
    add_agent_cli_args(parser)  # --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser
    EngineArgs.add_cli_args(parser)
    add_compat_cli_args(parser)


def cmd_serve(args: argparse.Namespace, build: Any = None) -> int:
    """Run the server; returns the process exit code (1 when the engine cannot start).

    `build` is `run_server`'s app builder (default the OpenAI app; the legacy
    /generate server, entrypoints/api_server.py, passes its own).
    """
    from tokenmill.entrypoints.openai.api_server import run_server
    from tokenmill.frontend.core_client import EngineStartupError
    from tokenmill.platforms import warn_if_cuda_torch_without_gpu

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        print(f"Error: two different models given: {args.model_tag!r} and --model {args.model!r}.", file=sys.stderr)
        return 2
    args.model = args.model_tag if args.model_tag is not None else args.model
    warn_if_cuda_torch_without_gpu()
    try:
        return asyncio.run(run_server(args, build))
    except (ValueError, EngineStartupError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


def make_parser() -> argparse.ArgumentParser:
    """The top-level parser with every available subcommand."""
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: an LLM inference and serving engine.")
    parser.add_argument("--version", action="version", version=f"tokenmill {get_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    try:
        add_serve_parser(subparsers)
    except ModuleNotFoundError as exc:  # without the serve extra: `serve` says what to install
        message = missing_extra_message(exc, "serve")
        if message is None:
            raise
        # No option prefix: every argument after `serve` lands in `rest`, so any command line gets the message.
        stub = subparsers.add_parser("serve", help="Start the OpenAI-compatible HTTP server.", add_help=False,
                                     prefix_chars="\0")
        stub.add_argument("rest", nargs="*")
        stub.set_defaults(func=lambda args: _fail(message))
    for command, (module_name, help_text) in SUBCOMMAND_MODULES.items():
        module = _import_subcommand(module_name)
        if module is None:
            continue
        if hasattr(module, "register"):
            module.register(subparsers)
        else:  # parses its own argv; listed here only for --help
            subparsers.add_parser(command, help=help_text, add_help=False)
    return parser


def _fail(message: str) -> int:
    print(f"Error: {message}", file=sys.stderr)
    return 1


def _import_subcommand(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:  # the module exists but one of its imports is missing: a real bug
            raise
        return None


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point (`tokenmill ...`). Returns the exit code.

    Args:
        argv: the arguments after `tokenmill`; None reads `sys.argv`, and then
            a server that has stopped exits the process at once (see below).
    """
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMAND_MODULES:
        try:
            module = _import_subcommand(SUBCOMMAND_MODULES[argv[0]][0])
            if module is not None and not hasattr(module, "register"):
                return int(module.main(argv[1:]) or 0)
        except ModuleNotFoundError as exc:
            message = missing_extra_message(exc, argv[0])
            if message is None:
                raise
            return _fail(message)
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
    except ModuleNotFoundError as exc:
        message = missing_extra_message(exc, args.command or "")
        if message is None:
            raise
        code = _fail(message)
    if from_command_line and args.func is cmd_serve:
        # Everything is shut down; tearing down torch and transformers at
        # interpreter exit would keep a stopped server alive for seconds.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
