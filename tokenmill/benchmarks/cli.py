"""`tokenmill bench {serve,throughput,latency,plot}`: argument parsing and dispatch.

`main(argv)` is what `tokenmill bench ...` calls; `python -m
tokenmill.benchmarks.cli serve ...` does the same. Each subcommand's module
owns its flags (`add_cli_args`) and its work (`main(args)`); heavy imports
(aiohttp, the engine, matplotlib) happen inside those `main`s.
"""

from __future__ import annotations

import argparse
import sys

from tokenmill.benchmarks import latency, plot, serve, throughput

_COMMANDS = {
    "serve": (serve, "Load-test an OpenAI-compatible server with streaming requests (vLLM's flags). A server "
                     "started with --api-key needs OPENAI_API_KEY set to that key."),
    "throughput": (throughput, "Offline throughput of tokenmill.LLM on a batch of prompts."),
    "latency": (latency, "Offline latency of one batch through tokenmill.LLM."),
    "plot": (plot, "Plot throughput and latency against max concurrency from serve result files."),
}


def make_parser(prog: str = "tokenmill bench") -> argparse.ArgumentParser:
    """The `bench` parser with one subparser per command."""
    parser = argparse.ArgumentParser(prog=prog, description="tokenmill benchmarks (vLLM's `vllm bench` flags).")
    subs = parser.add_subparsers(dest="bench_command", required=True, metavar="{serve,throughput,latency,plot}")
    for name, (module, help_text) in _COMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        module.add_cli_args(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one bench command; return the process exit status (0 ok, 1 user error, 2 bad flags).

    User mistakes (`ValueError`) are printed as one `error:` line instead of
    a traceback.
    """
    try:
        args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:  # --help (0) or a flag argparse rejected (2, message already printed)
        return e.code if isinstance(e.code, int) else 2
    module, _ = _COMMANDS[args.bench_command]
    try:
        module.main(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
