"""Harmony (gpt-oss) format: vocabulary, rendering, and parsing of recorded output token sequences.

The sequences below are gpt-oss-style assistant turns as token ids of the
o200k_harmony encoding (written down once from the encoding; each test
first checks that they decode to the harmony text shown next to them).
"""

from __future__ import annotations

import hashlib
import os
import struct

import pytest

from tokenmill.entrypoints.openai.harmony import encoding as harmony_encoding
from tokenmill.entrypoints.openai.harmony.chat import HarmonyChatOutputParser
from tokenmill.entrypoints.openai.harmony.encoding import O200K_SHA256, load_encoding, quicktok_to_tiktoken
from tokenmill.entrypoints.openai.harmony.parse import HarmonyStreamer, parse_output
from tokenmill.entrypoints.openai.harmony.render import render_chat, stop_token_ids

REASONING_THEN_FINAL = [200005, 35644, 200008, 1844, 3727, 1719, 13, 40500, 167705, 13, 200007, 200006, 173781,
                        200005, 17196, 200008, 13225, 0, 3253, 665, 357, 1652, 30, 200002]
REASONING_THEN_FINAL_TEXT = ("<|channel|>analysis<|message|>User greets. Reply politely.<|end|><|start|>assistant"
                             "<|channel|>final<|message|>Hello! How can I help?<|return|>")
TOOL_CALL = [200005, 35644, 200008, 23483, 290, 11122, 13, 200007, 200006, 173781, 200005, 12606, 815, 316, 28,
             44580, 775, 170154, 220, 200003, 4108, 200008, 10848, 17500, 1243, 392, 72782, 18583, 200012]
TOOL_CALL_TEXT = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
                  'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')
AFTER_TOOL_RESULT = [200005, 35644, 200008, 3206, 382, 46726, 13, 200007, 200006, 173781, 200005, 17196, 200008,
                     72782, 25, 220, 455, 363, 11, 46726, 13, 200002]
AFTER_TOOL_RESULT_TEXT = ("<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final"
                          "<|message|>Paris: 20 C, sunny.<|return|>")
NO_HEADER = [43627, 6391]  # "Plain words": the model never opened a channel
BROKEN_AFTER_FINAL = [200005, 17196, 200008, 12194, 200007, 188183]  # "<|channel|>final<|message|>Hi<|end|>oops"

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def enc():
    return load_encoding()


def stream_deltas(ids: list[int], step: int) -> tuple[list[dict], HarmonyStreamer]:
    """Feed `ids` `step` new tokens at a time (as DELTA outputs carry them), then finish; all deltas in order."""
    s = HarmonyStreamer()
    deltas: list[dict] = []
    for k in range(0, len(ids), step):
        deltas += s.update(ids[k:k + step])
    deltas += s.update([], final=True)
    return deltas, s


def joined(deltas: list[dict]) -> dict:
    """Deltas folded into message fields (what a client accumulates)."""
    out: dict = {"reasoning_content": "", "content": "", "tool_calls": {}}
    for d in deltas:
        out["reasoning_content"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = out["tool_calls"].setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in c:
                call["id"], call["name"] = c["id"], c["function"]["name"]
            call["arguments"] += c["function"]["arguments"]
    return out


def test_recorded_sequences_decode_to_their_text(enc) -> None:
    assert enc.decode(REASONING_THEN_FINAL) == REASONING_THEN_FINAL_TEXT
    assert enc.decode(TOOL_CALL) == TOOL_CALL_TEXT
    assert enc.decode(AFTER_TOOL_RESULT) == AFTER_TOOL_RESULT_TEXT
    assert enc.decode(NO_HEADER) == "Plain words"
    assert enc.decode(BROKEN_AFTER_FINAL) == "<|channel|>final<|message|>Hi<|end|>oops"


def test_stop_tokens_are_return_and_call(enc) -> None:
    assert sorted(stop_token_ids()) == sorted(enc.encode("<|return|><|call|>", allowed_special="all")) \
        == [200002, 200012]


def test_reasoning_then_final() -> None:
    out = parse_output(REASONING_THEN_FINAL)
    assert (out.reasoning, out.content, out.tool_calls) == ("User greets. Reply politely.", "Hello! How can I help?",
                                                            [])
    fields, finish = HarmonyChatOutputParser().message(REASONING_THEN_FINAL, "stop")
    assert fields == {"content": "Hello! How can I help?", "reasoning_content": "User greets. Reply politely."}
    assert finish == "stop"


def test_tool_call() -> None:
    out = parse_output(TOOL_CALL)
    assert out.reasoning == "Need the weather." and out.content is None
    assert len(out.tool_calls) == 1
    call = out.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    fields, finish = HarmonyChatOutputParser().message(TOOL_CALL, "stop")
    assert finish == "tool_calls" and fields["tool_calls"][0]["function"]["name"] == "get_weather"


def test_tool_call_without_its_stop_token_is_closed_at_eos() -> None:
    """The engine may drop the stop token <|call|>: EOS closes the call all the same."""
    out = parse_output(TOOL_CALL[:-1])
    assert [c["function"] for c in out.tool_calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_tool_result_then_final_answer(enc) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "reasoning_content": "OLD THOUGHT", "content": "Hello!"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": "Need the weather.", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20, "sky": "sunny"}'},
    ]
    prompt = enc.decode(render_chat(messages, TOOLS, "low", start_date="2026-12-01"))
    assert prompt.startswith("<|start|>system<|message|>")
    assert "Current date: 2026-12-01" in prompt and "Reasoning: low" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nAnswer briefly.\n\n# Tools" in prompt
    assert "type get_weather = (_: {\ncity: string,\n}) => any;" in prompt
    # Reasoning before the final answer "Hello!" is dropped; the tool loop's is kept.
    assert "OLD THOUGHT" not in prompt
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": '
        '"Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20, "sky": "sunny"}'
        "<|end|><|start|>assistant")
    out = parse_output(AFTER_TOOL_RESULT)
    assert (out.reasoning, out.content, out.tool_calls) == ("It is sunny.", "Paris: 20 C, sunny.", [])


def test_render_errors() -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        render_chat([{"role": "user", "content": "x"}], reasoning_effort="extreme")
    with pytest.raises(ValueError, match="matches no earlier assistant tool call"):
        render_chat([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "nope", "content": "1"}])
    with pytest.raises(ValueError, match="unknown role"):
        render_chat([{"role": "narrator", "content": "x"}])


def test_malformed_sequences_keep_the_text_as_content() -> None:
    out = parse_output(NO_HEADER)
    assert (out.reasoning, out.content, out.tool_calls) == (None, "Plain words", [])
    out = parse_output(BROKEN_AFTER_FINAL)
    assert (out.reasoning, out.content, out.tool_calls) == (None, "Hioops", [])


@pytest.mark.parametrize("ids", [REASONING_THEN_FINAL, TOOL_CALL, AFTER_TOOL_RESULT, NO_HEADER, BROKEN_AFTER_FINAL],
                         ids=["reasoning_final", "tool_call", "after_tool_result", "no_header", "broken"])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streaming_equals_non_streaming(ids: list[int], step: int) -> None:
    deltas, streamer = stream_deltas(ids, step)
    whole = parse_output(ids)
    got = joined(deltas)
    assert got["reasoning_content"] == (whole.reasoning or "")
    assert got["content"] == (whole.content or "")
    assert [(c["name"], c["arguments"]) for c in got["tool_calls"].values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole.tool_calls]
    # The streamed ids are the ones the streamer's own result reports.
    assert [c["id"] for c in got["tool_calls"].values()] == [c["id"] for c in streamer.result().tool_calls]


def test_streamed_tool_call_opens_with_a_header_then_argument_fragments() -> None:
    deltas, _ = stream_deltas(TOOL_CALL, 1)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["type"] == "function"
    assert all("id" not in c and c["index"] == 0 for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"city": "Paris"}'
    assert HarmonyStreamer().finish_reason("stop") == "stop"


def test_text_parsers_registered_under_vllm_names() -> None:
    from tokenmill.entrypoints.openai.reasoning.parsers import get_reasoning_parser
    from tokenmill.entrypoints.openai.tool_parsers.registry import make_tool_parser

    split = get_reasoning_parser("openai_gptoss")().extract_reasoning(REASONING_THEN_FINAL_TEXT)
    assert (split.reasoning, split.content) == ("User greets. Reply politely.", "Hello! How can I help?")
    found = make_tool_parser("openai").extract_tool_calls(TOOL_CALL_TEXT)
    assert found.tools_called and [(c.name, c.arguments) for c in found.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]


def test_quicktok_layout_converts_to_tiktoken_lines() -> None:
    # count=2; token b"!" rank 0; token b"ab" rank 7
    data = struct.pack("<I", 2) + struct.pack("<H", 1) + b"!" + struct.pack("<I", 0) \
        + struct.pack("<H", 2) + b"ab" + struct.pack("<I", 7)
    assert quicktok_to_tiktoken(data) == b"IQ== 0\nYWI= 7\n"
    with pytest.raises(ValueError, match="truncated"):
        quicktok_to_tiktoken(data[:-3])
    with pytest.raises(ValueError, match="trailing"):
        quicktok_to_tiktoken(data + b"x")


def test_o200k_vocab_from_quicktok_has_tiktokens_hash(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(harmony_encoding.ENCODINGS_BASE_ENV, raising=False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    root = harmony_encoding.ensure_o200k_vocab()
    assert root == tmp_path / "tiktoken"
    assert hashlib.sha256((root / "o200k_base.tiktoken").read_bytes()).hexdigest() == O200K_SHA256
    # ensure_o200k_vocab exported the folder for openai-harmony (monkeypatch restores it afterwards).
    assert os.environ[harmony_encoding.ENCODINGS_BASE_ENV] == str(root)


def test_o200k_missing_says_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(harmony_encoding.ENCODINGS_BASE_ENV, raising=False)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(harmony_encoding, "quicktok_vocab_path", lambda: None)
    with pytest.raises(RuntimeError, match="quicktok-v1"):
        harmony_encoding.ensure_o200k_vocab()


def test_harmony_detection() -> None:
    from types import SimpleNamespace

    from tokenmill.entrypoints.openai.harmony.chat import uses_harmony

    assert uses_harmony(SimpleNamespace(model_type="gpt_oss"), None, None)
    assert uses_harmony(SimpleNamespace(model_type="llama"), "openai", None)
    assert uses_harmony(None, None, "openai_gptoss")
    assert not uses_harmony(SimpleNamespace(model_type="llama"), "hermes", "qwen3")
