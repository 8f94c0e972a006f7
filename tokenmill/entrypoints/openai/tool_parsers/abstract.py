"""ToolParser: model text -> OpenAI `tool_calls`, the shared part of every format.

Each format (hermes, qwen3_coder, llama3_json, mistral) only implements
`parse(text, final)`: split the text so far into the plain content before
the first call and the calls seen so far, each with its name (once known)
and a prefix of its arguments' final JSON text. Everything else is shared:

- `extract_tool_calls(text)`: the finished text -> content + calls; text
  whose calls do not parse comes back whole as plain content.
- `ToolCallStreamer` (streaming.py): successive `parse` results -> OpenAI's
  tool-call deltas.

Invariant every `parse` keeps: `PartialToolCall.arguments` only grows
between calls on a growing text, and at completion equals the final
arguments string, so streamed fragments concatenate to it.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id(style: str = "openai") -> str:
    """A fresh id: `call_<24 alphanumerics>` (OpenAI) or 9 alphanumerics (Mistral's templates require it)."""
    alphabet = string.ascii_letters + string.digits
    if style == "mistral":
        return "".join(secrets.choice(alphabet) for _ in range(9))
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


@dataclass(slots=True)
class ToolCall:
    """One finished call, in OpenAI's shape (`to_dict()`)."""

    name: str
    arguments: str  # a JSON object as text
    id: str = field(default_factory=make_tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ExtractedToolCalls:
    """Result of parsing a finished output."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # text outside the calls (None when there is none)


@dataclass(slots=True)
class PartialToolCall:
    """A call seen so far in a (possibly unfinished) text."""

    name: str | None  # None until the whole name has been generated
    arguments: str  # a prefix of the final arguments JSON text ("" when none yet)
    complete: bool  # the call's end was seen and it parsed


@dataclass(slots=True)
class PartialParse:
    """What `parse` found.

    content: plain text before the first call (for a final text with no
        calls, all of it). While streaming, a tail that could be the start
        of a call marker is held back.
    calls: calls in order.
    failed: the text after a call marker is not a valid call (malformed);
        the caller then treats the whole text as content.
    """

    content: str
    calls: list[PartialToolCall] = field(default_factory=list)
    failed: bool = False


class ToolParser:
    """Base of the format parsers.

    Args:
        tokenizer: the model's tokenizer (unused by the text formats; kept
            for parity with vLLM's constructor).
        tools: the request's `tools` (OpenAI shape); formats that write
            argument values as bare text use them to type the values.
    """

    name = "base"
    id_style = "openai"
    # Markers that open a call; a streamed tail that is a prefix of one is held back.
    start_markers: tuple[str, ...] = ()
    # Markers are special tokens that must survive detokenization.
    needs_special_tokens = False

    def __init__(self, tokenizer: Any = None, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or []

    def parameters_schema(self, function_name: str) -> dict[str, Any]:
        """The `properties` of a requested function's parameters ({} when unknown)."""
        for t in self.tools:
            fn = t.get("function", t) if isinstance(t, dict) else {}
            if fn.get("name") == function_name:
                params = fn.get("parameters") or {}
                return params.get("properties") or {}
        return {}

    def parse(self, text: str, final: bool) -> PartialParse:  # pragma: no cover - abstract
        raise NotImplementedError

    def content_before(self, text: str, marker: str, final: bool) -> tuple[PartialParse, int]:
        """The parse of the plain content before the first `marker`, and that marker's offset.

        Without the marker the offset is -1 and all of `text` is content,
        except while streaming (not `final`): a tail that could begin one of
        `start_markers` is held back ("Hi <tool_" -> "Hi ").
        """
        first = text.find(marker)
        if first < 0:
            return PartialParse(text if final else text[: len(text) - held_back(text, self.start_markers)]), -1
        return PartialParse(text[:first]), first

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """Calls and remaining content of a finished output.

        Malformed calls (bad JSON, missing name, unclosed markers) give
        `tools_called=False` and the whole text as content.
        """
        parsed = self.parse(text, final=True)
        if parsed.failed or not parsed.calls or not all(c.complete and c.name for c in parsed.calls):
            return ExtractedToolCalls(False, [], text)
        calls = [ToolCall(c.name or "", c.arguments, make_tool_call_id(self.id_style)) for c in parsed.calls]
        return ExtractedToolCalls(True, calls, parsed.content or None)


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker.

    "Hello <tool_" with marker "<tool_call>" -> 6 (the tail "<tool_" waits
    for more text before it is sent as content).
    """
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


def scan_json_value(text: str, start: int) -> tuple[int, bool]:
    """Scan one JSON object/array starting at text[start] ('{' or '[').

    Returns:
        (end, complete): complete is True when the brackets balance at
        text[end - 1]; else end = len(text) (the value runs on).
    """
    depth = 0
    in_string = False
    escape = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
    return len(text), False


def json_call_from_object(obj_text: str, complete: bool, args_keys: tuple[str, ...]) -> PartialToolCall | None:
    """A call written as one JSON object `{"name": ..., "<args key>": {...}}` (whole or partial).

    The arguments stream as the raw text of the arguments value: its prefix
    while the object is open, exactly the value once it is complete (then
    re-serialized compactly only if it is not already an object text).
    Returns None when a complete object is not a valid call.
    """
    if complete:
        try:
            obj = json.loads(obj_text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        raw = _raw_args_text(obj_text, args_keys)
        if raw is not None:
            try:
                if json.loads(raw) == args:
                    return PartialToolCall(obj["name"], raw, True)
            except json.JSONDecodeError:
                pass
        return PartialToolCall(obj["name"], json.dumps(args, ensure_ascii=False), True)
    name = _partial_name(obj_text)
    raw = _raw_args_text(obj_text, args_keys)
    return PartialToolCall(name, raw or "", False)


def _partial_name(obj_text: str) -> str | None:
    """The value of "name" once its closing quote has been generated."""
    key = obj_text.find('"name"')
    if key < 0:
        return None
    colon = obj_text.find(":", key + 6)
    if colon < 0:
        return None
    q = obj_text.find('"', colon + 1)
    if q < 0:
        return None
    end, ok = _scan_string(obj_text, q)
    if not ok:
        return None
    try:
        return json.loads(obj_text[q:end])
    except json.JSONDecodeError:
        return None


def _scan_string(text: str, q: int) -> tuple[int, bool]:
    """End (exclusive) of the JSON string opening at text[q] == '"', and whether it closed."""
    escape = False
    for i in range(q + 1, len(text)):
        ch = text[i]
        if escape:
            escape = False
        elif ch == "\\":
            escape = True
        elif ch == '"':
            return i + 1, True
    return len(text), False


def _raw_args_text(obj_text: str, args_keys: tuple[str, ...]) -> str | None:
    """The raw text of the arguments value (whole, or its prefix so far), or None if not started."""
    for k in args_keys:
        key = obj_text.find(f'"{k}"')
        if key < 0:
            continue
        colon = obj_text.find(":", key + len(k) + 2)
        if colon < 0:
            return None
        i = colon + 1
        while i < len(obj_text) and obj_text[i] in " \t\r\n":
            i += 1
        if i >= len(obj_text) or obj_text[i] not in "{[":
            return None
        end, _ = scan_json_value(obj_text, i)
        return obj_text[i:end].rstrip()
    return None
