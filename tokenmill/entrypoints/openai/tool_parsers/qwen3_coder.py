"""Qwen3-Coder XML format: one `<tool_call>` block per call, parameters as bare text:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are typed with the request's tool schema (integer/number/boolean/
object/array are parsed as JSON; strings stay text); a parameter the
schema does not know stays a string. Arguments are built as compact JSON
`{"city": "Paris", "days": 3}` and stream one whole parameter at a time.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract import PartialParse, PartialToolCall, ToolParser
from tokenmill.entrypoints.openai.tool_parsers.registry import register_tool_parser

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@register_tool_parser("qwen3_coder", "qwen3_xml")
class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    start_markers = (START,)

    def parse(self, text: str, final: bool) -> PartialParse:
        out, pos = self.content_before(text, START, final)
        while pos >= 0:
            close = text.find(END, pos)
            block = text[pos + len(START): close if close >= 0 else len(text)]
            call = self._parse_block(block, closed=close >= 0 or final)
            if call is None:
                out.failed = final or close >= 0 or not _may_become_function(block)
                return out
            out.calls.append(call)
            if not call.complete:
                out.failed = final
                return out
            pos = text.find(START, close + len(END)) if close >= 0 else -1
        return out

    def _parse_block(self, block: str, closed: bool) -> PartialToolCall | None:
        m = _FUNCTION.search(block)
        if m is None or block[: m.start()].strip():
            return None
        name = m.group(1).strip()
        body = block[m.end():]
        fn_end = body.find("</function>")
        complete = fn_end >= 0
        params_text = body[:fn_end] if complete else body
        props = self.parameters_schema(name)
        parts = []
        for p in _PARAM.finditer(params_text):
            key = p.group(1).strip()
            value = _convert(_strip_newline(p.group(2)), props.get(key))
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
        if complete:
            return PartialToolCall(name, "{" + ", ".join(parts) + "}", True)
        if closed:
            return None  # </tool_call> (or the end) without </function>
        return PartialToolCall(name, "{" + ", ".join(parts) if parts else "", False)


def _strip_newline(value: str) -> str:
    """The format puts the value on its own line(s): drop one leading and one trailing newline."""
    value = value.removeprefix("\n")
    value = value.removesuffix("\n")
    return value


def _convert(value: str, schema: dict[str, Any] | None) -> Any:
    """Bare text -> the JSON value the parameter's schema type asks for (text when unsure)."""
    if not schema:
        return value
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "string" in kinds or kind is None and "enum" in schema:
        return value
    v = value.strip()
    if v.lower() in ("null", "none") and "null" in kinds:
        return None
    if "boolean" in kinds and v.lower() in ("true", "false"):
        return v.lower() == "true"
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return value


def _may_become_function(block: str) -> bool:
    """The block is still only whitespace or a prefix of `<function=`."""
    s = block.strip()
    return not s or "<function=".startswith(s) or s.startswith("<function=")

