"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): thinking text -> `reasoning_content`."""

from tokenmill.entrypoints.openai.reasoning.parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningSplit,
    get_reasoning_parser,
    reasoning_parser_names,
)
from tokenmill.entrypoints.openai.reasoning.streaming import ReasoningStreamer
from tokenmill.entrypoints.openai.harmony import reasoning_parser as _harmony  # noqa: F401 - "openai_gptoss"

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser", "ReasoningSplit",
           "ReasoningStreamer", "get_reasoning_parser", "reasoning_parser_names"]
