"""`--tool-call-parser openai` (vLLM's name for gpt-oss's harmony tool calls).

With this name the server renders and parses through harmony on token ids
(`harmony/chat.py`); this text parser is what the name means on detokenized
text that kept the special tokens: each `... to=functions.NAME ... <|message|>ARGS<|call|>`
(or up to `<|end|>` / the end of the text) is a call.
"""

from __future__ import annotations

import re

from tokenmill.entrypoints.openai.tool_parsers.abstract import PartialParse, PartialToolCall, ToolParser
from tokenmill.entrypoints.openai.tool_parsers.registry import register_tool_parser

_CALL = re.compile(r"to=functions\.([\w.-]+)[^<]*(?:<\|constrain\|>\w+)?<\|message\|>(.*?)(<\|call\|>|<\|end\|>|$)",
                   re.DOTALL)
_FINAL = re.compile(r"<\|channel\|>final<\|message\|>(.*?)(?:<\|return\|>|<\|end\|>|$)", re.DOTALL)


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    """Harmony tool calls in text; content is the `final` channel's text."""

    name = "openai"
    start_markers = ("to=functions.",)
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> PartialParse:
        calls = [PartialToolCall(m.group(1), m.group(2), bool(m.group(3)) or final) for m in _CALL.finditer(text)]
        content = "".join(m.group(1) for m in _FINAL.finditer(text))
        return PartialParse(content, calls)
