"""Tool-call parsers: model text -> OpenAI `tool_calls` (hermes, qwen3_coder, llama3_json, mistral)."""

from tokenmill.entrypoints.openai.harmony import tool_parser as _harmony  # noqa: F401 - registers "openai"
from tokenmill.entrypoints.openai.tool_parsers import hermes, llama3_json, mistral, qwen3_coder  # noqa: F401
from tokenmill.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolCall, ToolParser
from tokenmill.entrypoints.openai.tool_parsers.registry import get_tool_parser, make_tool_parser, tool_parser_names

__all__ = ["ExtractedToolCalls", "ToolCall", "ToolParser", "get_tool_parser", "make_tool_parser", "tool_parser_names"]
