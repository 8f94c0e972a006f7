"""Chat completions and /v1/responses for a harmony model, in-process over a scripted fake engine.

`ScriptedHarmonyEngine` reports `model_type: gpt_oss` and answers every
request with the next recorded harmony token sequence, one token per
output, the way the engine streams; the real engine and the real `openai`
client run the same sequences in tests/e2e/test_harmony_server.py.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import FakeEngine, FakeStream, asgi_call
from test_harmony_format import AFTER_TOOL_RESULT, REASONING_THEN_FINAL, TOOL_CALL, TOOLS

from tokenmill.entrypoints.openai.harmony.encoding import load_encoding
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams


class ScriptedHarmonyEngine(FakeEngine):
    """A gpt-oss stand-in: request k gets `scripts[k]` as its output token ids."""

    def __init__(self, scripts: list[list[int]]) -> None:
        super().__init__()
        self.max_model_len = 4096
        self.model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="gpt_oss"), model="fake-gpt-oss")
        self.scripts = list(scripts)
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0,
                    stream: FakeStream | None = None) -> FakeStream:
        ids = list(prompt)
        self.prompts.append(ids)
        self.params.append(params)
        script = self.scripts.pop(0)
        enc = load_encoding()
        stream = stream or FakeStream(self)
        stream.unfinished.add(request_id)
        for k in range(1, len(script) + 1):
            done = k == len(script) or script[k - 1] in params.all_stop_token_ids
            comp = CompletionOutput(index=0, text=enc.decode(script[:k]), token_ids=script[:k],
                                    finish_reason="stop" if done else None)
            stream.push(RequestOutput(request_id, None, ids, [comp], done), params.output_kind)
            if done:
                break
        return stream


def post(engine: Any, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    from tokenmill.entrypoints.openai.api_server import build_app

    app = build_app(engine, ["fake-gpt-oss"])
    return asyncio.run(asgi_call(app, "POST", path, body))


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


WEATHER_Q = [{"role": "user", "content": "Weather in Paris?"}]


def test_chat_reasoning_then_final() -> None:
    engine = ScriptedHarmonyEngine([REASONING_THEN_FINAL])
    status, raw = post(engine, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["message"]["reasoning_content"] == "User greets. Reply politely."
    assert choice["message"]["content"] == "Hello! How can I help?"
    assert choice["finish_reason"] == "stop"
    enc = load_encoding()
    prompt = enc.decode(engine.prompts[0])
    assert prompt.startswith("<|start|>system<|message|>") and prompt.endswith(
        "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    assert {200002, 200012} <= set(engine.params[0].stop_token_ids)


def test_chat_tool_call_stream_and_not() -> None:
    body = {"messages": WEATHER_Q, "tools": TOOLS}
    status, raw = post(ScriptedHarmonyEngine([TOOL_CALL]), "/v1/chat/completions", body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Need the weather."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == \
        [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]

    status, raw = post(ScriptedHarmonyEngine([TOOL_CALL]), "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    chunks = sse_events(raw)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert reasoning == "Need the weather."
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


def test_chat_tool_result_turn_is_rendered() -> None:
    engine = ScriptedHarmonyEngine([AFTER_TOOL_RESULT])
    messages = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "20 C"}]
    status, raw = post(engine, "/v1/chat/completions", {"messages": messages, "tools": TOOLS})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["message"]["content"] == "Paris: 20 C, sunny."
    assert load_encoding().decode(engine.prompts[0]).endswith(
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20 C<|end|><|start|>assistant")


@pytest.mark.parametrize("extra, needle", [
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_chat_options_harmony_cannot_honour_are_refused(extra: dict[str, Any], needle: str) -> None:
    status, raw = post(ScriptedHarmonyEngine([TOOL_CALL]), "/v1/chat/completions", {"messages": WEATHER_Q, **extra})
    assert status == 400 and needle in json.loads(raw)["error"]["message"]


def test_chat_tool_choice_none_hides_the_tools() -> None:
    engine = ScriptedHarmonyEngine([REASONING_THEN_FINAL])
    status, raw = post(engine, "/v1/chat/completions", {"messages": WEATHER_Q, "tools": TOOLS, "tool_choice": "none"})
    assert status == 200, raw
    assert "get_weather" not in load_encoding().decode(engine.prompts[0])


def test_responses_tool_call_then_function_call_output() -> None:
    engine = ScriptedHarmonyEngine([TOOL_CALL, AFTER_TOOL_RESULT])
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    status, raw = post(engine, "/v1/responses", {"input": "Weather in Paris?", "tools": tools,
                                                 "reasoning": {"effort": "high"}})
    assert status == 200, raw
    first = json.loads(raw)
    assert [it["type"] for it in first["output"]] == ["reasoning", "function_call"]
    assert first["output"][0]["content"] == [{"type": "reasoning_text", "text": "Need the weather."}]
    call = first["output"][1]
    assert (call["name"], call["arguments"]) == ("get_weather", '{"city": "Paris"}')
    assert "Reasoning: high" in load_encoding().decode(engine.prompts[0])
    assert first["usage"]["output_tokens"] == len(TOOL_CALL)

    # The next turn: the call's output, chained through previous_response_id (the app keeps its store).
    from tokenmill.entrypoints.openai.api_server import build_app

    app = build_app(engine, ["fake-gpt-oss"])
    engine.scripts = [TOOL_CALL, AFTER_TOOL_RESULT]
    first = json.loads(asyncio.run(asgi_call(app, "POST", "/v1/responses",
                                             {"input": "Weather in Paris?", "tools": tools}))[1])
    call = first["output"][1]
    status, raw = asyncio.run(asgi_call(app, "POST", "/v1/responses", {
        "previous_response_id": first["id"], "tools": tools,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "20 C"}]}))
    assert status == 200, raw
    second = json.loads(raw)
    assert [it["type"] for it in second["output"]] == ["reasoning", "message"]
    assert second["output"][1]["content"][0]["text"] == "Paris: 20 C, sunny."
    prompt = load_encoding().decode(engine.prompts[-1])
    # The loop's reasoning, the call and its output are all in the second prompt.
    assert prompt.endswith(
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": '
        '"Paris"}<|call|>'
        "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>20 C<|end|><|start|>assistant")


def test_responses_stream_events_match_the_whole_response() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    status, raw = post(ScriptedHarmonyEngine([TOOL_CALL]), "/v1/responses",
                       {"input": "Weather in Paris?", "tools": tools, "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    compact = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas folded
    assert compact == ["response.created", "response.in_progress",
                       "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                       "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                       "response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == \
        final["output"][0]["content"][0]["text"] == "Need the weather."
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        final["output"][1]["arguments"] == '{"city": "Paris"}'
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]


@pytest.mark.parametrize("body, needle", [
    ({"input": [{"type": "image_generation_call"}]}, "unknown input item type"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "needs a `name`"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "only function tools"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "schema"),
    ({"input": "x", "text": {"format": "json"}}, "text.format"),
    ({"input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]}, "call_id"),
    ({"input": "x", "seed": -2**70}, "seed"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "description": 3}]}, "description"),
    ({"input": "x", "tool_choice": {"type": "function", "name": ["f"]}, "tools": [{"type": "function", "name": "f"}]},
     "tool_choice"),
])
def test_responses_bad_input_is_400(body: dict[str, Any], needle: str) -> None:
    status, raw = post(FakeEngine(), "/v1/responses", body)
    assert status == 400, raw
    err = json.loads(raw)["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_responses_store_lru_and_get() -> None:
    from tokenmill.entrypoints.openai.serving_responses import ResponseStore, StoredResponse

    store = ResponseStore(max_stored=2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # "a" is now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2

    from tokenmill.entrypoints.openai.api_server import build_app

    app = build_app(FakeEngine(), ["fake-model"])
    created = json.loads(asyncio.run(asgi_call(app, "POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                                                                "instructions": "Be terse."}))[1])
    assert created["status"] == "incomplete" and created["incomplete_details"] == {"reason": "max_output_tokens"}
    status, raw = asyncio.run(asgi_call(app, "GET", f"/v1/responses/{created['id']}"))
    assert status == 200 and json.loads(raw) == created
    status, raw = asyncio.run(asgi_call(app, "GET", "/v1/responses/resp_missing"))
    assert status == 404 and "resp_missing" in json.loads(raw)["error"]["message"]
    not_stored = json.loads(asyncio.run(asgi_call(app, "POST", "/v1/responses",
                                                  {"input": "hi", "max_output_tokens": 2, "store": False}))[1])
    assert asyncio.run(asgi_call(app, "GET", f"/v1/responses/{not_stored['id']}"))[0] == 404


def test_structured_output_applies_to_the_final_answer_only() -> None:
    engine = ScriptedHarmonyEngine([REASONING_THEN_FINAL])
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    status, raw = post(engine, "/v1/chat/completions", {"messages": WEATHER_Q, "response_format": fmt})
    assert status == 200, raw
    so = engine.params[0].structured_outputs
    assert so is not None and so.json is not None
    # The grammar starts after <|channel|>final<|message|>.
    assert so.reasoning_end_token_ids == [200005, 17196, 200008]
