"""`--reasoning-parser openai_gptoss` (vLLM's name): harmony's `analysis` channel is the reasoning.

With this name the server parses harmony on token ids (`harmony/chat.py`).
This text form serves detokenized output that kept the special tokens:
reasoning is the `analysis` message, content the `final` message.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.reasoning.parsers import ReasoningParser, _held, register_reasoning_parser

ANALYSIS, END = "<|channel|>analysis<|message|>", "<|end|>"
FINAL, RETURN = "<|channel|>final<|message|>", "<|return|>"


@register_reasoning_parser("openai_gptoss")
class GptOssReasoningParser(ReasoningParser):
    """analysis text -> reasoning; final text -> content; the markers between them are dropped."""

    name = "openai_gptoss"
    start_token, end_token = ANALYSIS, END

    def split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        a = text.find(ANALYSIS)
        if a >= 0:
            body = text[a + len(ANALYSIS):]
            e = body.find(END)
            reasoning = body if e < 0 else body[:e]
            if e < 0 and not final:
                reasoning = reasoning[: len(reasoning) - _held(reasoning, END)]
        f = text.find(FINAL)
        if f >= 0:
            content = text[f + len(FINAL):].split(RETURN)[0].split(END)[0]
            if not final:
                content = content[: len(content) - max(_held(content, RETURN), _held(content, END))]
        elif a < 0 and final:
            content = text  # no harmony markers at all: plain text
        return reasoning, content
