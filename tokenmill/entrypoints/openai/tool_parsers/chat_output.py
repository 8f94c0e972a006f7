"""The response side: model text -> chat message fields (content, reasoning_content, tool_calls).

`ChatOutputParser` is built once per request from the server flags and the
request's `ToolPlan`; `message(text, finish_reason)` gives the
non-streaming message, `streamer()` a per-choice object whose
`update(new_text, final)` gives the delta dicts a stream sends for the text
generated since the previous update (the engine's DELTA outputs).

Order of work: the reasoning parser (if any) splits off the thinking text
first; only the content part goes to tool-call parsing. Forced calls
(`tool_choice` required / named) are read straight from the JSON the
grammar produced, not through the format parser.
"""

from __future__ import annotations

import json
from typing import Any

from tokenmill.entrypoints.openai.reasoning.parsers import ReasoningParser, get_reasoning_parser
from tokenmill.entrypoints.openai.reasoning.streaming import ReasoningStreamer
from tokenmill.entrypoints.openai.tool_parsers.abstract import (
    PartialParse,
    PartialToolCall,
    ToolParser,
)
from tokenmill.entrypoints.openai.tool_parsers.chat_tools import ToolPlan
from tokenmill.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from tokenmill.entrypoints.openai.tool_parsers.registry import make_tool_parser
from tokenmill.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer


class RequiredCallsParser(ToolParser):
    """`tool_choice: "required"` output: a JSON array `[{"name": ..., "arguments": {...}}, ...]`."""

    name = "required"

    def parse(self, text: str, final: bool) -> PartialParse:
        out = PartialParse("")
        body = text.lstrip()
        if not body:
            out.failed = final
            return out
        if body[0] != "[":
            out.failed = True
            return out
        MistralToolParser._parse_array(body, final, out)
        return out


class NamedCallParser(ToolParser):
    """`tool_choice` naming function X: the output is X's arguments object."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> PartialParse:
        args = text.strip() if final else text.lstrip()
        complete = final
        if final:
            try:
                complete = isinstance(json.loads(args), dict)
            except json.JSONDecodeError:
                complete = False
        return PartialParse("", [PartialToolCall(self.function_name, args, complete)], failed=final and not complete)


class ChatOutputParser:
    """Per-request output parsing.

    Args:
        plan: the request's tool plan.
        tool_call_parser: `--tool-call-parser` name (used in "auto" mode).
        reasoning_parser: `--reasoning-parser` name, or None.
        prompt_text: the tail of the rendered prompt (tells whether thinking
            was opened by the template); may be None.
        tokenizer: passed to the parsers.

    Raises:
        ValueError: unknown parser names.
    """

    def __init__(self, plan: ToolPlan, tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 prompt_text: str | None = None, tokenizer: Any = None) -> None:
        self.plan = plan
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self.reasoning_cls: type[ReasoningParser] | None = None
        self.in_reasoning = False
        if reasoning_parser:
            self.reasoning_cls = get_reasoning_parser(reasoning_parser)
            self.in_reasoning = self.reasoning_cls.starts_in_reasoning(prompt_text)
        if plan.mode == "auto" and tool_call_parser:
            make_tool_parser(tool_call_parser, tokenizer)  # fail early on a bad name

    def set_prompt_text(self, prompt_text: str | None) -> None:
        """Note the rendered prompt's tail: a template that opened `<think>` starts the output in reasoning."""
        if self.reasoning_cls is not None:
            self.in_reasoning = self.reasoning_cls.starts_in_reasoning(prompt_text)

    @property
    def needs_special_tokens(self) -> bool:
        """The format's markers are special tokens: keep them in the detokenized text."""
        if self.plan.mode != "auto" or not self.tool_call_parser:
            return False
        return bool(make_tool_parser(self.tool_call_parser, self.tokenizer).needs_special_tokens)

    def _tool_parser(self) -> ToolParser | None:
        if self.plan.mode == "named":
            assert self.plan.named_function is not None
            return NamedCallParser(self.plan.named_function)
        if self.plan.mode == "required":
            return RequiredCallsParser()
        if self.plan.mode == "auto" and self.tool_call_parser:
            return make_tool_parser(self.tool_call_parser, self.tokenizer, tools=self.plan.tools)
        return None

    def _reasoning(self) -> ReasoningParser | None:
        return self.reasoning_cls(self.in_reasoning) if self.reasoning_cls else None

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """(message fields, finish_reason) of a finished choice.

        Message fields: `content` (str or None), plus `reasoning_content`
        when a reasoning parser is set and `tool_calls` when calls were made
        (then finish_reason "stop" becomes "tool_calls").
        """
        fields: dict[str, Any] = {}
        content: str | None = text
        rp = self._reasoning()
        if rp is not None:
            split = rp.extract_reasoning(text)
            fields["reasoning_content"] = split.reasoning
            content = split.content
        parser = self._tool_parser()
        if parser is not None and content is not None:
            if self.plan.mode == "auto" and not any(m in content for m in parser.start_markers):
                pass  # no call marker at all: plain text
            else:
                found = parser.extract_tool_calls(content)
                if found.tools_called:
                    fields["tool_calls"] = [c.to_dict() for c in found.tool_calls]
                    content = found.content if self.plan.mode == "auto" else None
                    if finish_reason == "stop":
                        finish_reason = "tool_calls"
        fields["content"] = content
        return fields, finish_reason

    def streamer(self) -> ChoiceStreamer:
        return ChoiceStreamer(self._reasoning(), self._tool_parser())


class ChoiceStreamer:
    """One choice's streaming state: reasoning split, then tool-call deltas on the content part.

    The reasoning and tool-call parsers read the whole output so far (a tag
    or a call's JSON may be split over chunks), so with either of them the
    text is kept here, added to once per update; without them each update's
    text goes out as it is and nothing is kept.
    """

    def __init__(self, reasoning: ReasoningParser | None, tool_parser: ToolParser | None) -> None:
        self.reasoning = ReasoningStreamer(reasoning) if reasoning is not None else None
        self.tools = ToolCallStreamer(tool_parser) if tool_parser is not None else None
        self.content_sent = 0  # chars of content sent (reasoning parser, no tool parser)
        self.text = ""  # the output text so far (only kept for the parsers)

    @property
    def tools_called(self) -> bool:
        return self.tools is not None and self.tools.tools_called

    def update(self, new_text: str, final: bool = False) -> list[dict[str, Any]]:
        """The deltas to send for `new_text` (the output text generated since the previous update), in order.

        First (if any) one with `reasoning_content` and/or `content`, then one
        per tool-call delta: a call's header (`index`, `id`, `type`,
        `function.name`, `function.arguments` "") and its argument fragments
        each go in their own delta, as OpenAI streams them. `final`: the
        choice finished (held-back tails are decided and sent).
        """
        if self.reasoning is None and self.tools is None:
            return [{"content": new_text}] if new_text else []
        self.text += new_text
        text = self.text
        delta: dict[str, Any] = {}
        content_text = text
        if self.reasoning is not None:
            r_delta, _ = self.reasoning.update(text, final)
            if r_delta:
                delta["reasoning_content"] = r_delta
            content_text = self.reasoning.content_so_far(text, final)
        calls: list[dict[str, Any]] = []
        if self.tools is None:
            if len(content_text) > self.content_sent:
                delta["content"] = content_text[self.content_sent:]
                self.content_sent = len(content_text)
        else:
            d = self.tools.update(content_text, final)
            if d.content:
                delta["content"] = d.content
            calls = d.tool_calls
        out = [delta] if delta else []
        out += [{"tool_calls": [c]} for c in calls]
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's finish reason: "tool_calls" when calls went out and the model stopped normally."""
        if reason == "stop" and self.tools_called:
            return "tool_calls"
        return reason
