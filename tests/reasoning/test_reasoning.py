"""Reasoning parsers on recorded outputs with and without thinking blocks, streaming and not."""

from __future__ import annotations

import pytest

from tokenmill.entrypoints.openai.reasoning import ReasoningStreamer, get_reasoning_parser, reasoning_parser_names

# (parser, prompt opened <think>, output, reasoning, content)
CASES = [
    ("qwen3", False, "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "\nThe user wants 2+2. That is 4.\n", "\n\nThe answer is 4."),
    ("qwen3", False, "The answer is 4.", None, "The answer is 4."),  # enable_thinking false
    ("qwen3", True, "Thinking without the tag (template opened it).</think>Answer: 4", 
     "Thinking without the tag (template opened it).", "Answer: 4"),
    ("qwen3", False, "<think>unfinished because of max_tokens", "unfinished because of max_tokens", None),
    ("qwen3", False, "<think></think>Empty thoughts.", None, "Empty thoughts."),
    ("qwen3", False, "<think>思考: 日本語 </think>答え", "思考: 日本語 ", "答え"),
    ("deepseek_r1", False, "Let me think. 3*3=9.</think>It is 9.", "Let me think. 3*3=9.", "It is 9."),
    ("deepseek_r1", False, "<think>With the tag.</think>Done.", "With the tag.", "Done."),
    ("deepseek_r1", False, "Still thinking when cut off", "Still thinking when cut off", None),
]


def test_names():
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parser_names())
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        get_reasoning_parser("nope")


@pytest.mark.parametrize(("name", "opened", "text", "reasoning", "content"), CASES)
def test_non_streaming(name, opened, text, reasoning, content):
    split = get_reasoning_parser(name)(opened).extract_reasoning(text)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize(("name", "opened", "text", "reasoning", "content"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_streaming_matches_and_never_leaks_tags(name, opened, text, reasoning, content, step):
    streamer = ReasoningStreamer(get_reasoning_parser(name)(opened))
    r_parts, c_parts = [], []
    for end in range(step, len(text) + step, step):
        r, c = streamer.update(text[:end])
        r_parts.append(r)
        c_parts.append(c)
    r, c = streamer.update(text, final=True)
    r_parts.append(r)
    c_parts.append(c)
    assert ("".join(r_parts) or None, "".join(c_parts) or None) == (reasoning, content)
    for part in r_parts + c_parts:  # a tag split across chunks is never sent as text
        assert "<think" not in part and "</think" not in part and part not in ("<", "</", "</th")


def test_starts_in_reasoning_reads_the_prompt_tail():
    cls = get_reasoning_parser("qwen3")
    assert cls.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not cls.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not cls.starts_in_reasoning("<|im_start|>assistant\n")
    assert not cls.starts_in_reasoning(None)
