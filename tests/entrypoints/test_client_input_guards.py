"""No client input makes a 5xx: invalid Unicode, absurd nesting and wrongly typed message fields are 400s."""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import asgi_call

MSGS = [{"role": "user", "content": "Hi"}]


def _post_raw(app, path: str, raw: bytes) -> tuple[int, dict]:
    status, body = asyncio.run(asgi_call(app, "POST", path, raw))
    return status, json.loads(body)


def _with(body: dict, text_field: str) -> bytes:
    """`body` as JSON whose `text_field` placeholder becomes a lone surrogate escape."""
    return json.dumps(body).replace("@@", "\\ud800").encode()


SURROGATE_CASES = [
    ("/v1/completions", {"prompt": "a@@b", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "@@"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/completions", {"prompt": "ok", "stop": ["@@"], "max_tokens": 2}, "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x@@"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "@@"}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "@@", "content": "x"}]}, "messages[0].role"),
    ("/tokenize", {"prompt": "@@"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "@@"}]}, "messages[0].content"),
    ("/api/chat", {"model": "fake-model", "messages": [{"role": "user", "content": "@@"}]}, "messages[0].content"),
    ("/api/generate", {"model": "fake-model", "prompt": "@@"}, "prompt"),
]


@pytest.mark.parametrize("path, body, field", SURROGATE_CASES)
def test_lone_surrogates_are_400_naming_the_field(app, path, body, field):
    status, resp = _post_raw(app, path, _with(body, field))
    assert status == 400, resp
    message = resp["error"] if path.startswith("/api/") else resp["error"]["message"]
    assert f"`{field}`" in message and "surrogate" in message
    if not path.startswith("/api/"):
        assert resp["error"]["param"] == field


def test_raw_surrogate_bytes_are_400_too(app):
    raw = b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}'  # U+D800 encoded as if it were a character
    status, resp = _post_raw(app, "/v1/completions", raw)
    assert status == 400 and "surrogate" in resp["error"]["message"]


def test_paired_surrogates_are_a_normal_character(app):
    raw = b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    status, resp = _post_raw(app, "/v1/completions", raw)
    assert status == 200, resp


@pytest.mark.parametrize("depth", [100, 100_000])
def test_absurd_nesting_is_400(app, depth):
    raw = b'{"prompt": "x", "max_tokens": 2, "user": ' + b"[" * depth + b"]" * depth + b"}"
    status, resp = _post_raw(app, "/v1/completions", raw)
    assert status == 400 and "nests deeper" in resp["error"]["message"]


BAD_MESSAGES = {
    "tool-calls-string": {"role": "assistant", "content": "", "tool_calls": "call it"},
    "tool-calls-ints": {"role": "assistant", "content": "", "tool_calls": [1, 2]},
    "tool-calls-dict": {"role": "assistant", "content": "", "tool_calls": {"a": 1}},
    "tool-call-function-int": {"role": "assistant", "tool_calls": [{"type": "function", "function": 5}]},
    "tool-call-no-name": {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]},
    "tool-call-wrong-type": {"role": "assistant", "tool_calls": [{"type": "x", "function": {"name": "f"}}]},
    "tool-call-args-list": {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]},
    "tool-call-id-list": {"role": "tool", "content": "x", "tool_call_id": ["a"]},
    "content-int-parts": {"role": "user", "content": [1, 2]},
    "content-part-no-type": {"role": "user", "content": [{"text": "x"}]},
    "content-part-text-int": {"role": "user", "content": [{"type": "text", "text": 5}]},
    "content-dict": {"role": "user", "content": {"text": "x"}},
    "reasoning-int": {"role": "assistant", "content": "x", "reasoning_content": 5},
    "name-list": {"role": "user", "content": "x", "name": ["a"]},
    "image-part": {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]},
}


@pytest.mark.parametrize("name", sorted(BAD_MESSAGES))
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_wrongly_typed_message_fields_are_400(call, name, path):
    status, raw = call("POST", path, {"messages": [{"role": "user", "content": "q"}, BAD_MESSAGES[name]],
                                      "max_tokens": 2})
    assert status == 400, raw
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_well_typed_tool_turns_pass(call):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    status, raw = call("POST", "/tokenize", {"messages": msgs})  # the fake's 64-token context is too small to chat
    assert status == 200, raw
    assert json.loads(raw)["count"] > 0
