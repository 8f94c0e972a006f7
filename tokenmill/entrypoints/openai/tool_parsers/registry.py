"""The tool-call parser registry: `--tool-call-parser NAME` -> a `ToolParser` class."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_PARSERS: dict[str, type] = {}


def register_tool_parser(*names: str) -> Callable[[type], type]:
    """Class decorator: make the parser available under `names`."""

    def wrap(cls: type) -> type:
        for n in names:
            _PARSERS[n] = cls
        return cls

    return wrap


def get_tool_parser(name: str) -> type:
    """The parser class registered as `name`.

    Raises:
        ValueError: no parser has that name (the message lists the known ones).
    """
    import tokenmill.entrypoints.openai.tool_parsers  # noqa: F401 - registers the built-in parsers

    cls = _PARSERS.get(name)
    if cls is None:
        raise ValueError(f"Unknown tool call parser {name!r}; choose one of: {', '.join(sorted(_PARSERS))}.")
    return cls


def tool_parser_names() -> list[str]:
    import tokenmill.entrypoints.openai.tool_parsers  # noqa: F401

    return sorted(_PARSERS)


def make_tool_parser(name: str, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> Any:
    """An instance of parser `name` for one request (parsers keep per-request tool schemas)."""
    return get_tool_parser(name)(tokenizer, tools=tools)
