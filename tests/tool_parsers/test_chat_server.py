"""The chat endpoint with tool and reasoning parsers, over a scripted fake engine (no model).

The engine "generates" a fixed text a few characters per step, so the
non-streaming message and the SSE deltas can be checked against each other
and against the text.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))

from fake_engine import FakeEngine, FakeStream, asgi_call

from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

SCRIPT = ('Weighing it.</think>Let me look.<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tōkyō"}}'
          '\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]


class ScriptedEngine(FakeEngine):
    """Emits `self.script` 3 characters per step, then finishes with "stop"."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script = script
        self.prompts: list[Any] = []

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0,
                    stream: FakeStream | None = None) -> FakeStream:
        self.requests[request_id] = (list(prompt), params)
        self.prompts.append(prompt)
        stream = stream or FakeStream(self)
        stream.unfinished.add(request_id)
        cuts = list(range(3, len(self.script), 3)) + [len(self.script)]
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            cuts = cuts[-1:]
        for end in cuts:
            done = end == len(self.script)
            comp = CompletionOutput(index=0, text=self.script[:end], token_ids=list(range(end)),
                                    finish_reason="stop" if done else None)
            stream.push(RequestOutput(request_id, None, list(prompt), [comp], done), params.output_kind)
        return stream


def _post(app: Any, body: dict[str, Any]) -> tuple[int, bytes]:
    return asyncio.run(asgi_call(app, "POST", "/v1/chat/completions", body))


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_reasoning_and_auto_tool_calls_stream_like_the_full_message():
    engine = ScriptedEngine(SCRIPT)
    app = build_app(engine, ["m"], enable_auto_tool_choice=True, tool_call_parser="hermes",
                    reasoning_parser="deepseek_r1")
    body = {"messages": [{"role": "user", "content": "time in Tokyo?"}], "tools": TOOLS}
    status, raw = _post(app, body)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert msg["reasoning_content"] == "Weighing it." and msg["content"] == "Let me look."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_time" and json.loads(call["function"]["arguments"]) == {"tz": "Asia/Tōkyō"}
    # The tools reached the (tool-unaware) template through the fallback system message.
    prompt_text = "".join(chr(c) for c in engine.prompts[0])
    assert prompt_text.startswith("system: ") and '"get_time"' in prompt_text

    status, raw = _post(app, {**body, "stream": True})
    assert status == 200
    deltas = [e["choices"][0] for e in _events(raw) if e["choices"]]
    text = lambda key: "".join(d["delta"].get(key) or "" for d in deltas)
    assert text("reasoning_content") == "Weighing it." and text("content") == "Let me look."
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"] == {"name": "get_time", "arguments": ""}
    assert "".join(c["function"]["arguments"] for c in calls) == call["function"]["arguments"]
    assert deltas[-1]["finish_reason"] == "tool_calls"


def test_named_tool_choice_sets_the_grammar_and_returns_the_call():
    engine = ScriptedEngine('{"tz": "UTC"}')
    app = build_app(engine, ["m"])
    body = {"messages": [{"role": "user", "content": "time?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    status, raw = _post(app, body)
    assert status == 200, raw
    (_, params), = engine.requests.values()
    assert params.structured_outputs == StructuredOutputsParams(json=TOOLS[0]["function"]["parameters"])
    choice = json.loads(raw)["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz": "UTC"}'}


def test_request_errors_are_400():
    app = build_app(ScriptedEngine("x"), ["m"])
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        {"messages": msgs, "tools": TOOLS},  # auto without --enable-auto-tool-choice
        {"messages": msgs, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
            "type": "objekt"}}}},
        {"messages": msgs, "structured_outputs": {"regex": "("}},
        {"messages": msgs, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    ]
    for body in bad:
        status, raw = _post(app, body)
        assert status == 400, (body, raw)
        assert json.loads(raw)["error"]["message"]


def test_response_format_reaches_the_sampling_params():
    engine = ScriptedEngine("{}")
    app = build_app(engine, ["m"])
    status, _ = _post(app, {"messages": [{"role": "user", "content": "hi"}],
                            "response_format": {"type": "json_object"}})
    assert status == 200
    (_, params), = engine.requests.values()
    assert params.structured_outputs == StructuredOutputsParams(json_object=True)
