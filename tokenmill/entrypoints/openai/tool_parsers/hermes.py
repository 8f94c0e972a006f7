"""Hermes / Qwen2.5 / Qwen3 format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

Example (two parallel calls after some text):

    I'll check both.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_call>
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.abstract import (
    PartialParse,
    ToolParser,
    json_call_from_object,
    scan_json_value,
)
from tokenmill.entrypoints.openai.tool_parsers.registry import register_tool_parser

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    name = "hermes"
    start_markers = (START,)

    def parse(self, text: str, final: bool) -> PartialParse:
        out, pos = self.content_before(text, START, final)
        while pos >= 0:
            body_start = pos + len(START)
            close = text.find(END, body_start)
            body = text[body_start: close if close >= 0 else len(text)]
            stripped = body.lstrip()
            if not stripped:
                if final or close >= 0:
                    out.failed = True
                return out
            if stripped[0] != "{":
                out.failed = True
                return out
            j = len(body) - len(stripped)
            end, complete = scan_json_value(body, j)
            if close < 0 and not final and not complete:
                out.calls.append(json_call_from_object(body[j:end], False, ("arguments", "parameters")))
                return out
            call = json_call_from_object(body[j:end], True, ("arguments", "parameters")) if complete else None
            if call is None:
                out.failed = True
                return out
            out.calls.append(call)
            if close < 0:
                return out  # a complete object whose closing tag is not (yet) there
            pos = text.find(START, close + len(END))
        return out
