"""The tool-call parser registry: `--tool-call-parser NAME` -> a `ToolParser` class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenmill.entrypoints.openai.parser_registry import ParserRegistry

_REGISTRY: ParserRegistry[type] = ParserRegistry("tool call parser")


def register_tool_parser(*names: str) -> Callable[[type], type]:
    """Class decorator: make the parser available under `names`."""
    return _REGISTRY.register(*names)


def get_tool_parser(name: str) -> type:
    """The parser class registered as `name`.

    Raises:
        ValueError: no parser has that name (the message lists the known ones).
    """
    import tokenmill.entrypoints.openai.tool_parsers  # noqa: F401 - registers the built-in parsers

    return _REGISTRY.get(name)


def tool_parser_names() -> list[str]:
    import tokenmill.entrypoints.openai.tool_parsers  # noqa: F401

    return _REGISTRY.names()


def make_tool_parser(name: str, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> Any:
    """An instance of parser `name` for one request (parsers keep per-request tool schemas)."""
    return get_tool_parser(name)(tokenizer, tools=tools)
