"""Harmony output token ids -> chat fields (reasoning_content, content, tool_calls), streaming and not.

One `HarmonyStreamer` per choice is fed the new output token ids of each
DELTA output; it runs `openai_harmony.StreamableParser` over them and returns
the same delta dicts `tool_parsers.chat_output.ChoiceStreamer` returns:

    analysis channel                      -> {"reasoning_content": ...}
    final channel, commentary (preamble)  -> {"content": ...}
    commentary to=functions.NAME          -> a tool call: a header delta
                                             {"tool_calls": [{index, id, type, function: {name, arguments: ""}}]},
                                             then argument fragments
    any other recipient (built-in tools)  -> reasoning_content

A non-streaming output is the same streamer fed everything at once
(`parse_output`), so streamed and whole results agree by construction.

Malformed output (no harmony header, a token the parser refuses): from the
failing message on, the tokens are decoded as plain content, so nothing the
model wrote is lost.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.entrypoints.openai.harmony.encoding import load_encoding
from tokenmill.entrypoints.openai.tool_parsers.abstract import make_tool_call_id


@dataclass(slots=True)
class HarmonyOutput:
    """A finished assistant turn."""

    reasoning: str | None  # analysis text (None: none)
    content: str | None  # final / preamble text (None: none)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI `tool_calls` entries


class HarmonyStreamer:
    """Per-choice incremental parser.

    Args:
        encoding: the harmony encoding (default: `load_encoding()`).
    """

    def __init__(self, encoding: Any = None) -> None:
        from openai_harmony import Role, StreamableParser

        self.encoding = encoding or load_encoding()
        self.parser = StreamableParser(self.encoding, Role.ASSISTANT)
        self.num_seen = 0  # output tokens processed
        self.broken = False  # parser failed: the rest is plain content
        self.pending: list[int] = []  # tokens of a header not yet in content (decoded if the parse fails)
        self.opened = False  # the current message's channel/recipient was handled
        self.call_index = -1  # index of the open tool call, -1 when the message is not a call
        self.tool_calls: list[dict[str, Any]] = []
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.finished = False

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)

    def update(self, new_token_ids: list[int], final: bool = False) -> list[dict[str, Any]]:
        """Deltas for `new_token_ids`, the output tokens generated since the previous update.

        `final`: the turn is over; an unfinished message is closed (EOS).
        """
        from openai_harmony import StreamState

        out = _Deltas()
        if self.finished:
            return []
        for tok in new_token_ids:
            self.num_seen += 1
            if self.broken:
                self._plain(out, self.encoding.decode([tok]))
                continue
            try:
                self.parser.process(tok)
            except Exception:  # noqa: BLE001 - HarmonyError: the model left the format
                self._break(out, [tok])
                continue
            state = self.parser.state
            if state == StreamState.CONTENT:
                self.pending = []
                if not self.opened:
                    self._open(out)
                delta = self.parser.last_content_delta
                if delta:
                    self._emit(out, delta)
            else:
                if self.opened:  # the message ended (<|end|>, <|call|>, <|return|>)
                    self.opened, self.call_index = False, -1
                if state == StreamState.HEADER or self.pending:
                    self.pending.append(tok)
        if final:
            self.finished = True
            if not self.broken:
                try:
                    self.parser.process_eos()
                except Exception:  # noqa: BLE001 - EOS inside a header: malformed
                    self._break(out, [])
        return out.items

    def _open(self, out: _Deltas) -> None:
        """A message reached its content: start a tool call if it is addressed to a function."""
        self.opened = True
        recipient = self.parser.current_recipient or ""
        if recipient.startswith("functions."):
            self.call_index = len(self.tool_calls)
            call = {"id": make_tool_call_id(), "type": "function",
                    "function": {"name": recipient[len("functions."):], "arguments": ""}}
            self.tool_calls.append(call)
            out.call({"index": self.call_index, **json.loads(json.dumps(call))})

    def _emit(self, out: _Deltas, text: str) -> None:
        if self.call_index >= 0:
            self.tool_calls[self.call_index]["function"]["arguments"] += text
            out.call({"index": self.call_index, "function": {"arguments": text}})
        elif self.parser.current_channel == "analysis" or self.parser.current_recipient:
            self.reasoning_parts.append(text)
            out.reasoning(text)
        else:
            self._plain(out, text)

    def _plain(self, out: _Deltas, text: str) -> None:
        if text:
            self.content_parts.append(text)
            out.content(text)

    def _break(self, out: _Deltas, extra: list[int]) -> None:
        self.broken = True
        self._plain(out, self.encoding.decode(self.pending + extra))
        self.pending = []

    def result(self) -> HarmonyOutput:
        """Everything parsed so far as one output."""
        return HarmonyOutput("".join(self.reasoning_parts) or None, "".join(self.content_parts) or None,
                             [json.loads(json.dumps(c)) for c in self.tool_calls])

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" when the turn made calls and stopped normally (on <|call|>)."""
        return "tool_calls" if reason == "stop" and self.tool_calls else reason


class _Deltas:
    """Collects deltas in order, merging neighbouring text deltas into one dict."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def _text(self, key: str, text: str) -> None:
        if self.items and "tool_calls" not in self.items[-1]:
            last = self.items[-1]
            last[key] = last.get(key, "") + text
        else:
            self.items.append({key: text})

    def reasoning(self, text: str) -> None:
        self._text("reasoning_content", text)

    def content(self, text: str) -> None:
        self._text("content", text)

    def call(self, delta: dict[str, Any]) -> None:
        self.items.append({"tool_calls": [delta]})


def parse_output(token_ids: list[int], encoding: Any = None) -> HarmonyOutput:
    """Parse a finished assistant turn (the tokens after `<|start|>assistant`)."""
    s = HarmonyStreamer(encoding)
    s.update(token_ids, final=True)
    return s.result()
