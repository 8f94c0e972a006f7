"""Streams ask the engine for DELTA outputs and add them up themselves; whole answers ask for FINAL_ONLY.

A CUMULATIVE output copies the whole text, token ids and logprobs so far at
every step (O(length) per token per request), so the servers ask for DELTA
outputs when streaming, as vLLM's do. The fake engine hands DELTA outputs
over as the real one does (only what is new: `FakeStream.push`), so a handler
that took a DELTA output for the whole output so far (slicing it by what it
already sent, or counting usage from the last output) breaks the
stream == whole-answer checks below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import pytest
from fake_engine import FakeEngine, asgi_call, fake_completion_text

from tokenmill.entrypoints.api_server import build_generate_app
from tokenmill.entrypoints.openai.http_options import HTTPOptions
from tokenmill.sampling_params import RequestOutputKind

CHAT = [{"role": "user", "content": "hi"}]
# (path, body without `stream`) of every route that streams.
ROUTES = [
    ("/v1/completions", {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 3}),
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": 3}}),
    ("/api/chat", {"messages": CHAT, "options": {"num_predict": 3}}),
]


def _sse(raw: bytes) -> list[dict[str, Any]]:
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("path, body", ROUTES)
@pytest.mark.parametrize("stream", [True, False])
def test_streams_ask_for_delta_outputs_and_whole_answers_for_final_only(call, fake_engine, path, body, stream):
    status, raw = call("POST", path, {**body, "stream": stream})
    assert status == 200, raw
    want = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    assert fake_engine.requests
    assert [params.output_kind for _, params in fake_engine.requests.values()] == [want] * len(fake_engine.requests)


@pytest.mark.parametrize("stream", [True, False])
def test_legacy_generate_asks_for_delta_outputs_when_streaming(stream):
    engine = FakeEngine()
    app = build_generate_app(engine, ["m"], argparse.Namespace(api_key=None), HTTPOptions())
    status, _ = asyncio.run(asgi_call(app, "POST", "/generate", {"prompt": "Hi", "max_tokens": 2, "stream": stream}))
    assert status == 200
    ((_, params),) = engine.requests.values()
    assert params.output_kind == (RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)


@pytest.mark.parametrize("group", [1, 3])
def test_completion_stream_with_n_logprobs_and_usage_adds_up_to_the_whole_answer(call, fake_engine, group):
    body = {"prompt": "ab", "max_tokens": 6, "n": 2, "logprobs": 2}
    status, raw = call("POST", "/v1/completions", body)
    assert status == 200
    full = json.loads(raw)
    fake_engine.ready_group = group  # 3: a reader that fell behind gets several deltas at once
    status, raw = call("POST", "/v1/completions", {**body, "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True}})
    assert status == 200
    chunks = _sse(raw)
    for want in full["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == want["index"]]
        assert "".join(c["text"] for c in mine) == want["text"] == fake_completion_text(6)
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert [x for c in mine for x in c["logprobs"][key]] == want["logprobs"][key], key
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [want["finish_reason"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == 12
    # continuous usage: completion tokens so far, never more than the total, ending at it
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == 12


@pytest.mark.parametrize("group", [1, 3])
def test_chat_stream_with_n_and_logprobs_adds_up_to_the_whole_answer(call, fake_engine, group):
    body = {"messages": CHAT, "max_tokens": 5, "n": 2, "logprobs": True, "top_logprobs": 2}
    status, raw = call("POST", "/v1/chat/completions", body)
    assert status == 200
    full = json.loads(raw)
    fake_engine.ready_group = group
    status, raw = call("POST", "/v1/chat/completions", {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert status == 200
    chunks = _sse(raw)
    for want in full["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == want["index"]]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == want["message"]["content"]
        assert [x for c in mine[1:] for x in c["logprobs"]["content"]] == want["logprobs"]["content"]
        assert mine[-1]["finish_reason"] == want["finish_reason"] == "length"
    assert chunks[-1]["usage"] == full["usage"] and full["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize("path, piece", [("/api/generate", lambda x: x["response"]),
                                         ("/api/chat", lambda x: x["message"]["content"])])
def test_ollama_stream_adds_up_to_the_whole_answer(call, path, piece):
    body = dict(next(b for p, b in ROUTES if p == path), options={"num_predict": 5})
    status, raw = call("POST", path, {**body, "stream": False})
    assert status == 200
    full = json.loads(raw)
    status, raw = call("POST", path, {**body, "stream": True})
    assert status == 200
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert "".join(piece(x) for x in lines) == piece(full) == fake_completion_text(5)
    assert lines[-1]["eval_count"] == full["eval_count"] == 5
    assert lines[-1]["done_reason"] == full["done_reason"] == "length"


def test_legacy_generate_stream_sends_the_whole_texts_so_far_for_every_n():
    app = build_generate_app(FakeEngine(), ["m"], argparse.Namespace(api_key=None), HTTPOptions())
    body = {"prompt": "Hi", "max_tokens": 3, "n": 2}
    status, raw = asyncio.run(asgi_call(app, "POST", "/generate", {**body, "stream": True}))
    assert status == 200
    chunks = [json.loads(c) for c in raw.split(b"\0")[:-1]]
    assert chunks == [{"text": ["Hi" + fake_completion_text(k)] * 2} for k in (1, 2, 3)]
    status, raw = asyncio.run(asgi_call(app, "POST", "/generate", body))
    assert json.loads(raw) == chunks[-1]
