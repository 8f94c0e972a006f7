"""ReasoningStreamer: growing output text -> (reasoning_content delta, content delta).

Works on the whole text so far through `ReasoningParser.split`, so a tag
split over several chunks (`"</th"` then `"ink>"`) is never sent as text:
a tail that could start a tag is held until the next chunk decides it.
"""

from __future__ import annotations

from tokenmill.entrypoints.openai.reasoning.parsers import ReasoningParser


class ReasoningStreamer:
    """Per-choice state.

    Args:
        parser: the request's reasoning parser.
    """

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.reasoning_sent = 0  # chars of the reasoning part already sent
        self.content_sent = 0  # chars of the content part already sent

    def update(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new reasoning, new content) for the whole output text so far."""
        reasoning, content = self.parser.split(text, final)
        r_delta = reasoning[self.reasoning_sent:]
        c_delta = content[self.content_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        self.content_sent = max(self.content_sent, len(content))
        return r_delta, c_delta

    def content_so_far(self, text: str, final: bool = False) -> str:
        """The content part of `text` (what a tool parser should see)."""
        return self.parser.split(text, final)[1]
