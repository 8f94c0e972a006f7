"""Mistral formats, after the `[TOOL_CALLS]` token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]   (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}             (v11+ tokenizers)

`[TOOL_CALLS]` and `[ARGS]` are special tokens, so the request must keep
special tokens in its text (`needs_special_tokens`). Call ids are 9
alphanumerics, as Mistral's chat templates require.
"""

from __future__ import annotations

import json

from tokenmill.entrypoints.openai.tool_parsers.abstract import (
    PartialParse,
    PartialToolCall,
    ToolParser,
    json_call_from_object,
    scan_json_value,
)
from tokenmill.entrypoints.openai.tool_parsers.registry import register_tool_parser

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ARGS_KEYS = ("arguments", "parameters")


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    name = "mistral"
    id_style = "mistral"
    start_markers = (TOOL_CALLS,)
    needs_special_tokens = True

    def parse(self, text: str, final: bool) -> PartialParse:
        out, first = self.content_before(text, TOOL_CALLS, final)
        if first < 0:
            return out
        body = text[first + len(TOOL_CALLS):]
        stripped = body.lstrip()
        if not stripped:
            out.failed = final
            return out
        if stripped[0] == "[":
            self._parse_array(stripped, final, out)
        else:
            self._parse_name_args(body, final, out)
        return out

    @staticmethod
    def _parse_array(body: str, final: bool, out: PartialParse) -> None:
        """`[{...}, {...}]`: one call per object; the array may still be open."""
        pos = 1
        while True:
            while pos < len(body) and body[pos] in " \t\r\n,":
                pos += 1
            if pos >= len(body):
                out.failed = final
                return
            if body[pos] == "]":
                out.failed = not out.calls
                return
            if body[pos] != "{":
                out.failed = True
                return
            end, complete = scan_json_value(body, pos)
            call = json_call_from_object(body[pos:end], complete, _ARGS_KEYS)
            if complete and call is None or (not complete and final):
                out.failed = True
                return
            assert call is not None
            out.calls.append(call)
            if not complete:
                return
            pos = end

    @staticmethod
    def _parse_name_args(body: str, final: bool, out: PartialParse) -> None:
        """`name[ARGS]{...}` segments, each after its own `[TOOL_CALLS]`."""
        for segment in body.split(TOOL_CALLS):
            sep = segment.find(ARGS)
            if sep < 0:
                # Still arriving: the name, or the [ARGS] after it; anything else is malformed.
                out.failed = final or bool(segment.strip()) and not _could_be_name(segment)
                return
            name = segment[:sep].strip()
            args = segment[sep + len(ARGS):]
            a = args.lstrip()
            if not name or not _could_be_name(name) or (a and a[0] != "{"):
                out.failed = True
                return
            if not a:
                out.failed = final
                out.calls.append(PartialToolCall(name, "", False))
                return
            j = len(args) - len(a)
            end, complete = scan_json_value(args, j)
            if not complete:
                out.failed = final
                out.calls.append(PartialToolCall(name, args[j:end].rstrip(), False))
                return
            raw = args[j:end]
            try:
                ok = isinstance(json.loads(raw), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                out.failed = True
                return
            out.calls.append(PartialToolCall(name, raw, True))


def _could_be_name(segment: str) -> bool:
    """A name so far, or the start of `[ARGS]` after it."""
    s = segment.strip()
    cut = s.find("[")
    if cut >= 0:
        return ARGS.startswith(s[cut:]) and s[:cut].replace("_", "").replace("-", "").replace(".", "").isalnum()
    return s.replace("_", "").replace("-", "").replace(".", "").isalnum()
