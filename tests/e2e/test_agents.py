"""End to end: structured output, tool calling and streaming on a real `tokenmill serve` with SmolLM2.

Uses the session's `agent_server` (conftest.py: --max-model-len 1024,
`--enable-auto-tool-choice --tool-call-parser hermes`). Requests go out
concurrently so the engine batches them (the CPU is slow); every string in
the schemas has a maxLength and every array a maxItems so outputs stay
within max_tokens.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from typing import Any

import pytest
from optional_deps import require
from server_harness import no_keepalive

openai = require("openai")
jsonschema = require("jsonschema")
require("xgrammar")

pytestmark = pytest.mark.e2e

_MAX_TOKENS = 160


@pytest.fixture(scope="module")
def client(agent_server):
    """The openai client of the session's `agent_server` (conftest.py)."""
    return openai.OpenAI(base_url=f"{agent_server.base}/v1", api_key="none",
                         http_client=no_keepalive(), max_retries=0, timeout=300)


def _schemas() -> list[dict[str, Any]]:
    """50 schemas: flat records, nested objects, arrays of objects, enums, optional fields."""
    name = {"type": "string", "maxLength": 12}
    out: list[dict[str, Any]] = []
    colors = ["red", "green", "blue", "black", "white"]
    for i in range(10):  # flat, required + enum + bounded integer + boolean
        out.append({"type": "object", "properties": {
            "name": name, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"type": "string", "enum": colors[: 2 + i % 4]}, "active": {"type": "boolean"}},
            "required": ["name", "age", "color", "active"][: 2 + i % 3]})
    for i in range(10):  # nested object
        out.append({"type": "object", "properties": {
            "city": name, "location": {"type": "object", "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180}}, "required": ["lat", "lon"]},
            "country": {"type": "string", "enum": ["FR", "DE", "JP", "US"][: 2 + i % 3]}},
            "required": ["city", "location"] + (["country"] if i % 2 else [])})
    for i in range(10):  # arrays of scalars and of objects
        out.append({"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1,
                     "maxItems": 2 + i % 3},
            "items": {"type": "array", "maxItems": 2, "items": {"type": "object", "properties": {
                "sku": {"type": "string", "maxLength": 6}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"]}}},
            "required": ["tags", "items"]})
    for i in range(10):  # a top-level array / enum-only objects
        if i % 2:
            out.append({"type": "array", "minItems": 1, "maxItems": 3,
                        "items": {"type": "string", "enum": ["low", "mid", "high"]}})
        else:
            out.append({"type": "object", "properties": {
                "level": {"type": "string", "enum": ["low", "mid", "high"]},
                "ok": {"type": "boolean"}, "score": {"type": "integer", "minimum": 0, "maximum": 10 + i}},
                "required": ["level", "ok", "score"]})
    for i in range(10):  # deeper nesting with optional parts
        out.append({"type": "object", "properties": {
            "user": {"type": "object", "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": name,
                "roles": {"type": "array", "items": {"type": "string", "enum": ["admin", "dev", "ops"]},
                          "maxItems": 3}},
                "required": ["id", "name"] + (["roles"] if i % 2 else [])},
            "note": {"type": "string", "maxLength": 20}},
            "required": ["user"]})
    assert len(out) == 50
    return out


_TOPICS = ["a person", "a city", "an order", "a rating", "an account"]


def _chat(client: Any, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="", messages=messages, temperature=0, max_tokens=_MAX_TOKENS, **kw)


def test_fifty_json_schemas_all_validate(client):
    schemas = _schemas()

    def one(i: int) -> tuple[str, str]:
        rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
        msg = [{"role": "user", "content": f"Describe {_TOPICS[i // 10]} as JSON."}]
        r = _chat(client, msg, response_format=rf)
        return r.choices[0].message.content, r.choices[0].finish_reason

    def json_object() -> str:  # rides in the same batch
        r = _chat(client, [{"role": "user", "content": "Give me a JSON object about a cat."}],
                  response_format={"type": "json_object"})
        return r.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(51) as pool:
        obj = pool.submit(json_object)
        results = list(pool.map(one, range(50)))
    for i, (text, finish) in enumerate(results):
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), schemas[i])
    assert isinstance(json.loads(obj.result()), dict)


def test_choice_and_regex_always_match_and_streaming_agrees(client):
    choices = ["yes", "no", "maybe"]
    regexes = [r"\d{3}-\d{4}", r"[A-Z][a-z]{2,8}", r"(true|false)", r"[a-z]{3,6}@[a-z]{3,6}\.com", r"#[0-9a-f]{6}"]
    jobs: list[tuple[str, dict[str, Any], str]] = []
    for i in range(6):
        jobs.append(("choice", {"choice": choices}, f"Question {i}: is the sky blue? Answer."))
    for i, rx in enumerate(regexes):
        jobs.append(("regex", {"regex": rx}, f"Give an example value number {i}."))

    def run(job: tuple[str, dict[str, Any], str], stream: bool) -> str:
        kind, so, prompt = job
        if kind == "regex":  # completions endpoint for regexes, chat for choices
            kw = {"model": "", "prompt": prompt, "temperature": 0, "max_tokens": 40, "extra_body": {"structured_outputs": so}}
            if not stream:
                return client.completions.create(**kw).choices[0].text
            return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        msgs = [{"role": "user", "content": prompt}]
        if not stream:
            return _chat(client, msgs, extra_body={"structured_outputs": so}).choices[0].message.content
        chunks = _chat(client, msgs, extra_body={"structured_outputs": so}, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(2 * len(jobs)) as pool:
        plain = [pool.submit(run, j, False) for j in jobs]
        streamed = [pool.submit(run, j, True) for j in jobs]
        plain_texts = [f.result() for f in plain]
        stream_texts = [f.result() for f in streamed]
    for (kind, so, _), text, stext in zip(jobs, plain_texts, stream_texts):
        if kind == "choice":
            assert text in choices
        else:
            assert re.fullmatch(so["regex"], text), (so, text)
        assert stext == text


def test_json_streaming_gives_the_same_text(client):
    schema = _schemas()[12]
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    msgs = [{"role": "user", "content": "Describe a city as JSON."}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        plain = pool.submit(lambda: _chat(client, msgs, response_format=rf).choices[0].message.content)
        chunks = pool.submit(lambda: list(_chat(client, msgs, response_format=rf, stream=True)))
        text, stream = plain.result(), chunks.result()
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    jsonschema.validate(json.loads(text), schema)


def test_invalid_schema_and_regex_are_400(client):
    with pytest.raises(openai.BadRequestError):
        _chat(client, [{"role": "user", "content": "hi"}],
              response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}})
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "a(b"}})


_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
_TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone.",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 10}}, "required": ["tz"]}}}


def test_named_tool_choice_returns_a_parsable_call(client):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # one batch: plain and streamed
        plain = pool.submit(_chat, client, msgs, tools=[_WEATHER, _TIME], tool_choice=choice)
        streamed = pool.submit(lambda: [c for c in _chat(client, msgs, tools=[_WEATHER, _TIME], tool_choice=choice,
                                                         stream=True) if c.choices])
        r, chunks = plain.result(), streamed.result()
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), _WEATHER["function"]["parameters"])

    # Streaming: a header delta (id, name, arguments "") then fragments that add up to the same arguments.
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_choice_and_tool_results(client):
    msgs = [{"role": "user", "content": "What time is it in Tokyo?"}]
    r = _chat(client, msgs, tools=[_WEATHER, _TIME], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    schemas = {"get_weather": _WEATHER, "get_time": _TIME}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name]["function"]["parameters"])
    # A later turn with the tool result is accepted (auto: the model may answer in text or call again).
    follow = msgs + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": '{"time": "09:30"}'}]
    r2 = _chat(client, follow, tools=[_WEATHER, _TIME], max_completion_tokens=24)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
