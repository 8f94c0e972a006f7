"""End to end: harmony (gpt-oss format) through a real `tokenmill serve` and the real `openai` client.

gpt-oss itself is not in tokenmill yet, so the server runs a scripted
stand-in (scripted_harmony.py): the o200k_harmony tokenizer and a model whose
logits force recorded harmony turns. The server is started with vLLM's
`--tool-call-parser openai --reasoning-parser openai_gptoss`; what is
checked: prompts rendered by harmony, the stop on `<|call|>` / `<|return|>`
(the model keeps writing after them, and its generation config does not
stop there), `reasoning_content`, `tool_calls`, the tool-result turn, and
/v1/responses items and events, streaming and not.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
if importlib.util.find_spec("openai_harmony") is None:
    pytest.skip("openai-harmony is not installed (tokenmill[serve])", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints" / "harmony"))
from test_harmony_format import AFTER_TOOL_RESULT, REASONING_THEN_FINAL, TOOL_CALL  # noqa: E402

from scripted_harmony import sitecustomize_source, write_model_dir  # noqa: E402
from server_harness import API_KEY, ServerProcess, no_keepalive  # noqa: E402

MODEL = "scripted-gpt-oss"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city.",
                    "parameters": TOOLS[0]["function"]["parameters"]}]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harmony_server")
    model_dir = write_model_dir(tmp / "model")
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize_source())
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    srv = ServerProcess(tmp, [
        str(model_dir), "--served-model-name", MODEL, "--load-format", "dummy", "--dtype", "float32",
        "--no-enable-prefix-caching", "--max-model-len", "1024", "--kv-cache-memory-bytes", "64M",
        "--tool-call-parser", "openai", "--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice",
        "--api-key", API_KEY], env=env)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY,
                         http_client=no_keepalive(), max_retries=0, timeout=120)


def test_chat_reasoning_then_final(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
    msg = r.choices[0].message
    assert msg.content == "Hello! How can I help?"
    assert msg.model_extra["reasoning_content"] == "User greets. Reply politely."
    assert not msg.tool_calls
    # It stopped on <|return|>: exactly the recorded turn, although the model writes on after it.
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", len(REASONING_THEN_FINAL))


def test_chat_reasoning_then_final_streamed(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=64, stream=True)
    reasoning, content, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("User greets. Reply politely.", "Hello! How can I help?", "stop")


def test_chat_tool_call_stops_on_call(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert r.usage.completion_tokens == len(TOOL_CALL)  # ended on <|call|>
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")


def test_chat_tool_call_streamed(client) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=64, stream=True)
    names, args, finish = [], "", None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.function.name:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (names, args, finish) == (["get_weather"], '{"city": "Paris"}', "tool_calls")


def test_chat_tool_result_then_final(client) -> None:
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 20, "sky": "sunny"}'}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=64)
    assert r.choices[0].message.content == "Paris: 20 C, sunny."
    assert r.choices[0].message.model_extra["reasoning_content"] == "It is sunny."
    assert r.usage.completion_tokens == len(AFTER_TOOL_RESULT)


def test_responses_tool_loop(client) -> None:
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS,
                                    reasoning={"effort": "low"}, max_output_tokens=64)
    assert first.status == "completed"
    assert [it.type for it in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "Need the weather."
    call = first.output[1]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert first.usage.output_tokens == len(TOOL_CALL)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=RESPONSES_TOOLS,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temp_c": 20}'}], max_output_tokens=64)
    assert second.output_text == "Paris: 20 C, sunny."
    assert [it.type for it in second.output] == ["reasoning", "message"]
    assert second.usage.input_tokens > first.usage.input_tokens  # the first turn is in the prompt


def test_responses_stream(client) -> None:
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS,
                                 max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "Need the weather."
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == \
        '{"city": "Paris"}'
    assert [it.type for it in final.output] == ["reasoning", "function_call"]
    assert final.output[1].name == "get_weather"

    with client.responses.stream(model=MODEL, input="Hi", max_output_tokens=64) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == "Hello! How can I help?"
