"""Llama 3.x JSON format: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`;
parallel calls separated by `;`.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

Only an output that starts with the call (after whitespace) is a call; any
other text is plain content.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.tool_parsers.abstract import (
    PartialParse,
    ToolParser,
    json_call_from_object,
    scan_json_value,
)
from tokenmill.entrypoints.openai.tool_parsers.registry import register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_ARGS_KEYS = ("parameters", "arguments")


@register_tool_parser("llama3_json", "llama4_json")
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start_markers = (PYTHON_TAG, "{")
    needs_special_tokens = True  # keep <|python_tag|> in the text

    def parse(self, text: str, final: bool) -> PartialParse:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif not final and PYTHON_TAG.startswith(body):
            return PartialParse("")  # maybe the tag, still arriving
        if not body:
            return PartialParse(text if final else "")
        if body[0] != "{":
            return PartialParse(text)
        out = PartialParse("")
        pos = 0
        while True:
            end, complete = scan_json_value(body, pos)
            if not complete:
                if final:
                    out.failed = True
                else:
                    out.calls.append(json_call_from_object(body[pos:end], False, _ARGS_KEYS))
                return out
            call = json_call_from_object(body[pos:end], True, _ARGS_KEYS)
            if call is None:
                out.failed = True
                return out
            out.calls.append(call)
            rest = body[end:].lstrip()
            if not rest:
                return out
            if rest[0] != ";":
                out.failed = final  # trailing text after the calls
                return out
            rest = rest[1:].lstrip()
            if not rest:
                return out
            if rest[0] != "{":
                out.failed = True
                return out
            pos = len(body) - len(rest)
