"""End to end: POST /v1/responses on the bundled SmolLM2 through the `openai` client's Responses API.

Uses the session's production server (conftest.py `prod_server`: an API key,
--max-model-len 256), so outputs are kept short and every schema string has
a maxLength.
"""

from __future__ import annotations

import json

import pytest
from server_harness import API_KEY, http, no_keepalive

pytestmark = pytest.mark.e2e
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
               "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
                "parameters": CITY_SCHEMA}


class _Client:
    """The openai client's Responses API with this server's model name filled in."""

    def __init__(self, base: str) -> None:
        self.raw = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY,
                                 http_client=no_keepalive(), max_retries=0, timeout=180)
        self.model = self.raw.models.list().data[0].id

    def create(self, **kwargs):
        return self.raw.responses.create(model=self.model, **kwargs)

    def stream(self, **kwargs):
        return self.raw.responses.stream(model=self.model, **kwargs)


@pytest.fixture(scope="module")
def client(prod_server) -> _Client:
    return _Client(prod_server.base)


def test_text(client) -> None:
    r = client.create(input="Say hello in one word.", instructions="You are terse.", max_output_tokens=12,
                                temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert [it.type for it in r.output] == ["message"]
    assert r.output_text.strip()
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_equals_final_response(client) -> None:
    with client.stream(input="Count: one, two,", max_output_tokens=10, temperature=0) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    # As OpenAI: a response cut by max_output_tokens ends with response.incomplete (the SDK's
    # get_final_response() wants response.completed; test_harmony_server.py uses it on completed ones).
    final = events[-1].response
    assert (kinds[-1], final.status) in (("response.completed", "completed"), ("response.incomplete", "incomplete"))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    [done] = [e.text for e in events if e.type == "response.output_text.done"]
    assert deltas == done == final.output_text and deltas
    assert final.usage.output_tokens <= 10


def test_json_schema_output(client) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.create(input="Invent a person: name and age, as JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), schema)


def test_named_function_call_and_its_output(client) -> None:
    first = client.create(input="What is the weather in Paris?", tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    calls = [it for it in first.output if it.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY_SCHEMA)
    # The call's output goes back through previous_response_id; tool_choice "none" makes the model answer.
    second = client.create(previous_response_id=first.id, tools=[WEATHER_TOOL], tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "20 degrees C, sunny"}], max_output_tokens=24, temperature=0)
    assert [it.type for it in second.output] == ["message"] and second.output_text.strip()
    assert second.previous_response_id == first.id
    # The stateless form (the whole conversation as input items) builds the same prompt.
    stateless = client.create(
        tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=24, temperature=0, store=False,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "20 degrees C, sunny"}])
    assert stateless.usage.input_tokens == second.usage.input_tokens
    assert stateless.output_text == second.output_text


@pytest.mark.parametrize("kwargs, needle", [
    ({"input": [{"type": "computer_call_output", "call_id": "c1", "output": {}}]}, "unknown input item type"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": CITY_SCHEMA}]}, "needs a `name`"),
    ({"input": "hi", "previous_response_id": "resp_does_not_exist"}, "previous_response_id"),
])
def test_bad_input_is_400(client, kwargs, needle) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.create(max_output_tokens=4, **kwargs)
    assert info.value.status_code == 400
    err = info.value.body
    assert needle in err["message"] and err["type"] == "invalid_request_error"


def test_behind_the_api_key(prod_server) -> None:
    status, body, _ = http("POST", f"{prod_server.base}/v1/responses", {"input": "hi", "max_output_tokens": 2})
    assert status == 401 and "error" in json.loads(body)
