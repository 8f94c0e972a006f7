"""tools / tool_choice planning, prompt rendering with tools, and chat message / delta building."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tokenmill.entrypoints.openai.tool_parsers.agents import ChatAgentConfig
from tokenmill.entrypoints.openai.tool_parsers.chat_output import ChatOutputParser
from tokenmill.entrypoints.openai.tool_parsers.chat_tools import (
    apply_forced_tool_choice,
    fallback_messages,
    forced_structured_outputs,
    plan_tools,
    render_with_tools,
)
from tokenmill.sampling_params import StructuredOutputsParams

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}},
]


def test_plan_modes_and_errors():
    assert plan_tools(None, None, False, None).mode == "none"
    assert plan_tools(TOOLS, "auto", True, "hermes").mode == "auto"
    assert plan_tools(TOOLS, "none", False, None).mode == "none"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False, None)
    assert (named.mode, named.named_function) == ("named", "get_time")
    with pytest.raises(ValueError, match="enable-auto-tool-choice"):
        plan_tools(TOOLS, None, False, None)  # auto is the default with tools
    with pytest.raises(ValueError, match="not in tools"):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, False, None)
    with pytest.raises(ValueError, match="non-empty tools"):
        plan_tools([], "required", False, None)
    with pytest.raises(ValueError, match="tools\\[0\\]"):
        plan_tools([{"type": "function"}], "required", False, None)
    with pytest.raises(ValueError, match="tool_choice must be"):
        plan_tools(TOOLS, "sometimes", False, None)


def test_forced_schemas_accept_exactly_the_calls():
    required = forced_structured_outputs(plan_tools(TOOLS, "required", False, None))["json"]
    jsonschema.validate([{"name": "get_time", "arguments": {"tz": "UTC"}}], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "x"}}], required)
    single = plan_tools(TOOLS, "required", False, None)
    single.parallel_tool_calls = False
    one_call = forced_structured_outputs(single)["json"]
    call = {"name": "get_time", "arguments": {"tz": "UTC"}}
    jsonschema.validate([call], one_call)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call, call], one_call)
    jsonschema.validate([call, call], required)
    named = forced_structured_outputs(plan_tools(TOOLS, {"function": {"name": "get_weather"}}, False, None))
    assert named == {"json": TOOLS[0]["function"]["parameters"]}
    with pytest.raises(ValueError, match="cannot be combined"):
        apply_forced_tool_choice(plan_tools(TOOLS, "required", False, None),
                                 StructuredOutputsParams(json_object=True))


class _Tok:
    """A chat 'template' that ignores tools, like SmolLM2's."""

    def render(self, messages, tools=None, **kwargs):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


class _ToolTok(_Tok):
    def render(self, messages, tools=None, **kwargs):
        return ("TOOLS:" + json.dumps(tools) if tools else "") + super().render(messages)


def test_tools_reach_a_template_that_ignores_them_through_a_system_message():
    plan = plan_tools(TOOLS, "required", False, None)
    msgs = [{"role": "user", "content": "weather?"}]
    text = render_with_tools(_Tok().render, msgs, plan)
    assert text.startswith("<system>") and '"get_weather"' in text and "<tool_call>" in text
    assert render_with_tools(_ToolTok().render, msgs, plan).startswith("TOOLS:")


def test_tool_results_in_later_turns_are_rendered():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]
    msgs = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "09:30"}]
    out = fallback_messages(msgs, TOOLS)
    assert out[0]["role"] == "system"
    assert '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\n09:30\n</tool_response>"}
    text = render_with_tools(_Tok().render, msgs, plan_tools(TOOLS, "none", False, None))
    assert "09:30" in text and "get_time" in text


def test_messages_for_each_mode():
    auto = ChatOutputParser(plan_tools(TOOLS, "auto", True, "hermes"), "hermes")
    fields, finish = auto.message('Checking.<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
                                  "stop")
    assert finish == "tool_calls" and fields["content"] == "Checking."
    assert fields["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}
    fields, finish = auto.message("No call here.", "stop")
    assert (fields, finish) == ({"content": "No call here."}, "stop")

    named = ChatOutputParser(plan_tools(TOOLS, {"function": {"name": "get_weather"}}, False, None))
    fields, finish = named.message('{"city": "Paris"}', "stop")
    assert finish == "tool_calls" and fields["content"] is None
    assert fields["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    required = ChatOutputParser(plan_tools(TOOLS, "required", False, None))
    fields, _ = required.message('[{"name": "get_time", "arguments": {"tz": "UTC"}}, '
                                 '{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "stop")
    assert [c["function"]["name"] for c in fields["tool_calls"]] == ["get_time", "get_weather"]


def test_reasoning_then_tool_call_streaming():
    parser = ChatOutputParser(plan_tools(TOOLS, "auto", True, "hermes"), "hermes", "deepseek_r1")
    text = 'I should call it.</think>OK<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    fields, finish = parser.message(text, "stop")
    assert fields["reasoning_content"] == "I should call it." and fields["content"] == "OK" and finish == "tool_calls"
    s = parser.streamer()
    deltas = []
    for start in range(0, len(text), 4):  # the new text of each step, as DELTA outputs carry it
        deltas += s.update(text[start:start + 4])
    deltas += s.update("", final=True)
    assert s.text == text  # the parsers read the whole text so far, kept by the streamer
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should call it."
    assert "".join(d.get("content", "") for d in deltas) == "OK"
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"tz": "UTC"}'
    assert s.finish_reason("stop") == "tool_calls" and s.finish_reason("length") == "length"


def test_agent_config_checks_flags():
    with pytest.raises(ValueError, match="tool-call-parser"):
        ChatAgentConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="Unknown reasoning parser"):
        ChatAgentConfig(reasoning_parser="nope")


class _Engine:
    class tokenizer:
        @staticmethod
        def encode(text, add_special_tokens=False):
            return [ord(c) for c in text]

        @staticmethod
        def decode(ids):
            return "".join(chr(i) for i in ids)

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt

    def apply_chat_template(self, messages, **kwargs):
        return [ord(c) for c in self.prompt]


def test_tool_call_parser_without_auto_tool_choice_says_it_does_nothing():
    from tokenmill.entrypoints.openai.tool_parsers.agents import idle_parser_warning

    assert "--tool-call-parser hermes has no effect without --enable-auto-tool-choice" in idle_parser_warning(
        False, "hermes", harmony=False)
    assert idle_parser_warning(True, "hermes", harmony=False) is None
    assert idle_parser_warning(False, "openai", harmony=True) is None  # harmony takes "auto" without the flag
    assert idle_parser_warning(False, None, harmony=False) is None

def test_grammar_starts_after_reasoning_unless_the_prompt_closed_it():
    from types import SimpleNamespace

    from tokenmill.sampling_params import SamplingParams

    cfg = ChatAgentConfig(reasoning_parser="qwen3")
    req = SimpleNamespace(tools=None, tool_choice=None)
    msgs = [{"role": "user", "content": "hi"}]
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    cfg.prepare(_Engine("assistant\n<think>\n"), req, msgs, params)
    assert params.structured_outputs.reasoning_end_token_ids == [ord(c) for c in "</think>"]
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    cfg.prepare(_Engine("assistant\n<think>\n\n</think>\n\n"), req, msgs, params)  # enable_thinking: false
    assert params.structured_outputs.reasoning_end_token_ids is None
    plain = SamplingParams()
    cfg.prepare(_Engine("assistant\n"), req, msgs, plain)
    assert plain.structured_outputs is None
