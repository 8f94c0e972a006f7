"""Tool-call parsers on recorded model outputs of each format, streaming and not."""

from __future__ import annotations

import json
import random

import pytest

from tokenmill.entrypoints.openai.tool_parsers import get_tool_parser, make_tool_parser, tool_parser_names
from tokenmill.entrypoints.openai.tool_parsers.streaming import ToolCallStreamer

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "extra": {"type": "object"}}}}}]

# (parser, model output, expected [(name, arguments dict)], expected content)
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", {"city": "Paris"})], None),
    ("hermes", ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"CH\\"", '
               '"note": "a }{ brace"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "日本"}}'
               "\n</tool_call>"),
     [("get_weather", {"city": 'Zürich "CH"', "note": "a }{ brace"}), ("get_time", {"tz": "日本"})],
     "Let me check both."),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', [("f", {})], None),
    ("qwen3_coder", ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
                    "</tool_call>"),
     [("get_weather", {"city": "São Paulo", "days": 3, "metric": True})], None),
    ("qwen3_coder", ('Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nsay "hi"\nline 2\n</parameter>\n'
                    '<parameter=extra>\n{"a": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
                    "<function=get_time>\n<parameter=tz>\n+09:00\n</parameter>\n</function>\n</tool_call>"),
     [("get_weather", {"city": 'say "hi"\nline 2', "extra": {"a": [1, 2]}}), ("get_time", {"tz": "+09:00"})],
     "Sure."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [("get_weather", {"city": "Paris"})],
     None),
    ("llama3_json", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Köln \\"DE\\""}}; '
                    '{"name": "get_time", "parameters": {"tz": "CET"}}'),
     [("get_weather", {"city": 'Köln "DE"'}), ("get_time", {"tz": "CET"})], None),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]'),
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})], None),
    ("mistral", ('I will call it.[TOOL_CALLS]get_weather[ARGS]{"city": "Montréal", "q": "a]b"}'
                '[TOOL_CALLS]get_time[ARGS]{}'),
     [("get_weather", {"city": "Montréal", "q": "a]b"}), ("get_time", {})], "I will call it."),
]

MALFORMED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'),
    ("hermes", "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}'),
    ("llama3_json", '{"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par'),
    ("mistral", "[TOOL_CALLS]get weather now[ARGS]{}"),
]

PLAIN = [
    ("hermes", "The weather in Paris is sunny. Use <b>tags</b> freely."),
    ("qwen3_coder", "No tools needed: 2 < 3."),
    ("llama3_json", "Paris is the capital of France."),
    ("mistral", "Plain answer [with brackets]."),
]


def _stream(parser_name: str, text: str, chunks: list[int], tools=None) -> tuple[str, dict[int, list[dict]]]:
    streamer = ToolCallStreamer(make_tool_parser(parser_name, tools=tools))
    content, calls = "", {}
    pos = 0
    for size in chunks:
        pos = min(len(text), pos + size)
        d = streamer.update(text[:pos])
        content += d.content
        for tc in d.tool_calls:
            calls.setdefault(tc["index"], []).append(tc)
    d = streamer.update(text, final=True)
    content += d.content
    for tc in d.tool_calls:
        calls.setdefault(tc["index"], []).append(tc)
    return content, calls


def _chunkings(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    return [[1] * len(text), [7] * (len(text) // 7 + 1), [rng.randint(1, 12) for _ in range(len(text))]]


def test_registry_has_the_four_formats():
    assert {"hermes", "qwen3_coder", "llama3_json", "mistral"} <= set(tool_parser_names())
    with pytest.raises(ValueError, match="Unknown tool call parser"):
        get_tool_parser("nope")


@pytest.mark.parametrize(("name", "text", "expected", "content"), CASES)
def test_extract_calls(name, text, expected, content):
    got = make_tool_parser(name, tools=WEATHER_TOOLS).extract_tool_calls(text)
    assert got.tools_called
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == expected
    assert (got.content.strip() if got.content else None) == content
    ids = [c.to_dict()["id"] for c in got.tool_calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize(("name", "text", "expected", "content"), CASES)
def test_streaming_matches_non_streaming(name, text, expected, content):
    final = make_tool_parser(name, tools=WEATHER_TOOLS).extract_tool_calls(text)
    for chunks in _chunkings(text):
        streamed_content, calls = _stream(name, text, chunks, WEATHER_TOOLS)
        assert (streamed_content.strip() or None) == content
        assert sorted(calls) == list(range(len(expected)))
        for i, deltas in calls.items():
            head = deltas[0]
            # OpenAI's shape: the first delta has id, type, name and empty arguments; the rest only fragments.
            assert head["id"] and head["type"] == "function" and head["function"] == {
                "name": expected[i][0], "arguments": ""}
            assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:])
            args = "".join(d["function"]["arguments"] for d in deltas)
            assert args == final.tool_calls[i].arguments
            assert json.loads(args) == expected[i][1]


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_calls_come_back_as_plain_text(name, text):
    got = make_tool_parser(name, tools=WEATHER_TOOLS).extract_tool_calls(text)
    assert not got.tools_called and got.tool_calls == [] and got.content == text
    content, calls = _stream(name, text, [3] * len(text))
    assert calls == {} or all(len(v) >= 1 for v in calls.values())
    if not calls:
        assert content == text


@pytest.mark.parametrize(("name", "text"), PLAIN)
def test_plain_text_is_content(name, text):
    got = make_tool_parser(name).extract_tool_calls(text)
    assert not got.tools_called and got.content == text
    for chunks in _chunkings(text):
        content, calls = _stream(name, text, chunks)
        assert calls == {} and content == text


def test_marker_prefix_is_held_back_until_decided():
    streamer = ToolCallStreamer(make_tool_parser("hermes"))
    assert streamer.update("Hi <tool_").content == "Hi "
    d = streamer.update('Hi <tool_call>{"name": "f", "arguments": {"x": 1')
    assert d.content == "" and d.tool_calls[0]["function"]["name"] == "f"
    assert "".join(t["function"]["arguments"] for t in d.tool_calls) == '{"x": 1'
