"""Streams that fell behind: all queued outputs go out as one chunk per choice, with the same text and counts.

`FakeEngine.ready_group` makes the fake stream hand over several cumulative
outputs per `next_ready` (a consumer that fell behind: `OutputStream` merges
them into the latest one per request, the fake hands over all of them; the
handlers must diff against what they sent either way); the SSE body must
carry exactly the tokens, text, logprobs and usage of the
one-output-at-a-time stream, in fewer chunks.
"""

from __future__ import annotations

import json

import pytest
from fake_engine import fake_completion_text


def _chunks(raw: bytes) -> list[dict]:
    events = [e[len("data: "):] for e in raw.decode().split("\n\n")[:-1]]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _stream(call, fake_engine, group: int, body: dict) -> list[dict]:
    fake_engine.ready_group = group
    status, raw = call("POST", body.pop("path"), body)
    assert status == 200
    return _chunks(raw)


@pytest.mark.parametrize("group", [2, 3, 50])
def test_completion_stream_coalesced_keeps_text_logprobs_and_usage(call, fake_engine, group):
    body = {"prompt": "ab", "max_tokens": 7, "stream": True, "logprobs": 1, "n": 2,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    ref = _stream(call, fake_engine, 1, {**body, "path": "/v1/completions"})
    got = _stream(call, fake_engine, group, {**body, "path": "/v1/completions"})
    assert len(got) < len(ref)
    for chunks in (ref, got):
        for idx in (0, 1):
            mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == idx]
            assert "".join(c["text"] for c in mine) == fake_completion_text(7)
            assert sum(len(c["logprobs"]["tokens"]) for c in mine) == 7  # one logprob entry per token
            assert [c["finish_reason"] for c in mine][-1] == "length"
            assert [c["finish_reason"] for c in mine][:-1] == [None] * (len(mine) - 1)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 14
        assert chunks[-1]["usage"] == ref[-1]["usage"]
        assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)


def test_chat_stream_coalesced_keeps_content_and_finish(call, fake_engine):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    ref = _stream(call, fake_engine, 1, {**body, "path": "/v1/chat/completions"})
    got = _stream(call, fake_engine, 4, {**body, "path": "/v1/chat/completions"})
    assert len(got) < len(ref)
    for chunks in (ref, got):
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(d["delta"].get("content", "") for d in deltas) == fake_completion_text(5)
        assert deltas[-1]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 5


def _events(raw: bytes) -> list[dict]:
    return [json.loads(e.split("data: ", 1)[1]) for e in raw.decode().split("\n\n") if "data: " in e]


def test_responses_stream_coalesced_keeps_the_text(call, fake_engine):
    body = {"input": "hi", "max_output_tokens": 6, "stream": True}
    runs = {}
    for group in (1, 4):
        fake_engine.ready_group = group
        status, raw = call("POST", "/v1/responses", dict(body))
        assert status == 200
        runs[group] = _events(raw)
    for events in runs.values():
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert "".join(deltas) == fake_completion_text(6)
        assert events[-1]["type"] == "response.incomplete"
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == fake_completion_text(6)
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
    count = [sum(e["type"] == "response.output_text.delta" for e in runs[g]) for g in (1, 4)]
    assert count[1] < count[0]
