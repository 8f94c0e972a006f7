"""ToolCallStreamer: growing model text -> OpenAI's streamed `tool_calls` deltas.

OpenAI sends, per call: a first delta with `index`, `id`, `type` and
`function.name` (arguments ""), then deltas carrying only `index` and the
next `function.arguments` fragment. Concatenating a call's fragments gives
its final arguments string (the same one the non-streaming response has).

Content before the first call streams as ordinary `content`, except a tail
that could be the start of a call marker, held until it is decided.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.entrypoints.openai.tool_parsers.abstract import ToolParser, make_tool_call_id


@dataclass(slots=True)
class _SentCall:
    id: str
    args_sent: str = ""


@dataclass(slots=True)
class StreamDelta:
    """What to send for one update: a content fragment and tool-call deltas (either may be empty)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStreamer:
    """Per-choice streaming state over one `ToolParser`.

    Args:
        parser: the request's parser.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0  # chars of the text already sent as content
        self.calls: list[_SentCall] = []
        self.plain = False  # a malformed call was seen before any call went out: all text is content
        self.all_complete = False

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def update(self, text: str, final: bool = False) -> StreamDelta:
        """Deltas for the whole output text so far (`final`: the request finished)."""
        out = StreamDelta()
        if self.plain:
            return self._flush_content(text, out)
        parsed = self.parser.parse(text, final)
        if parsed.failed:
            if not self.calls:
                self.plain = True
                return self._flush_content(text, out)
            return out  # calls already went out; the malformed rest is dropped
        if len(parsed.content) > self.content_sent and not self.calls:
            out.content = parsed.content[self.content_sent:]
            self.content_sent = len(parsed.content)
        for i, call in enumerate(parsed.calls):
            if i == len(self.calls):
                if call.name is None:
                    break
                sent = _SentCall(make_tool_call_id(self.parser.id_style))
                self.calls.append(sent)
                out.tool_calls.append({"index": i, "id": sent.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}})
            sent = self.calls[i]
            if len(call.arguments) > len(sent.args_sent) and call.arguments.startswith(sent.args_sent):
                out.tool_calls.append({"index": i, "function": {"arguments": call.arguments[len(sent.args_sent):]}})
                sent.args_sent = call.arguments
        self.all_complete = bool(parsed.calls) and all(c.complete for c in parsed.calls) \
            and len(parsed.calls) == len(self.calls)
        if final and not self.calls:
            return self._flush_content(text, out)
        return out

    def _flush_content(self, text: str, out: StreamDelta) -> StreamDelta:
        if len(text) > self.content_sent:
            out.content += text[self.content_sent:]
            self.content_sent = len(text)
        return out
