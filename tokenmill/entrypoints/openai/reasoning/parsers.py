"""Reasoning parsers: split a thinking model's output into `reasoning_content` and `content`.

Two formats (vLLM's `--reasoning-parser` names):

- `qwen3`: `<think>reasoning</think>content`. The opening tag may be absent
  when the chat template already wrote it into the prompt (then the
  output starts inside the thinking block). An output that neither opens
  a block nor starts inside one (e.g. `enable_thinking: false`) is all
  content.
- `deepseek_r1`: the output starts inside the thinking block whether or not
  `<think>` is generated: text before `</think>` is reasoning; with no
  `</think>` at all (the model ran out of tokens while thinking), all of it
  is reasoning.

`starts_in_reasoning(prompt_text)` tells whether the prompt left a
thinking block open, which decides where a tag-less output starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.entrypoints.openai.parser_registry import ParserRegistry

START, END = "<think>", "</think>"

_REGISTRY: ParserRegistry[type[ReasoningParser]] = ParserRegistry("reasoning parser")


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    """Class decorator: make the parser available as `--reasoning-parser name`."""
    return _REGISTRY.register(name)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class for `--reasoning-parser NAME`.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    return _REGISTRY.get(name)


def reasoning_parser_names() -> list[str]:
    return _REGISTRY.names()


@dataclass(slots=True)
class ReasoningSplit:
    reasoning: str | None  # None when the output had no reasoning
    content: str | None  # None when the output had no content


class ReasoningParser:
    """Base: `<think>` / `</think>` tags; subclasses set `implicit_start`.

    Args:
        in_reasoning: the output begins inside a thinking block (the
            prompt opened it); see `starts_in_reasoning`.
    """

    name = "base"
    start_token, end_token = START, END
    # True: an output without <think> is still reasoning until </think> (DeepSeek-R1).
    implicit_start = False

    def __init__(self, in_reasoning: bool = False) -> None:
        self.in_reasoning_at_start = in_reasoning or self.implicit_start

    @classmethod
    def starts_in_reasoning(cls, prompt_text: str | None) -> bool:
        """True when the prompt ends inside an open thinking block (`...<think>\\n`)."""
        if not prompt_text:
            return False
        return prompt_text.rfind(cls.start_token) > prompt_text.rfind(cls.end_token)

    def extract_reasoning(self, text: str) -> ReasoningSplit:
        """Split a finished output."""
        reasoning, content = self.split(text, final=True)
        return ReasoningSplit(reasoning or None, content or None)

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the output so far.

        Unless `final`, a tail that could be the start of a tag is held back
        (in neither part), so streamed parts only ever grow.
        """
        lead = text.lstrip()
        opened = self.in_reasoning_at_start
        body = text
        if lead.startswith(self.start_token):
            body, opened = lead[len(self.start_token):], True
        elif not final and (not lead or self.start_token.startswith(lead)):
            return "", ""  # maybe <think>, still arriving
        if not opened:
            return "", text
        i = body.find(self.end_token)
        if i >= 0:
            return body[:i], body[i + len(self.end_token):]
        keep = 0 if final else _held(body, self.end_token)
        return body[: len(body) - keep], ""


def _held(text: str, tag: str) -> int:
    """Longest tail of `text` that is a proper prefix of `tag` ("abc</th" -> 4)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True
