"""`cache_salt` and `priority` in request bodies reach the engine; `usage.prompt_tokens_details.cached_tokens`.

The fake engine is wrapped so it records what the server submitted and
reports a known `num_cached_tokens` per prompt (the engine's prefix-cache
hits), which the server must sum into the usage object, streamed or not.
"""

from __future__ import annotations

import json

import pytest

CACHED_PER_PROMPT = 16


@pytest.fixture
def submitted(fake_engine):
    """List of (request_id, prompt as submitted, priority); outputs report CACHED_PER_PROMPT hits."""
    seen = []
    add = fake_engine.add_request

    def add_request(request_id, prompt, params, priority=0, stream=None):
        seen.append((request_id, prompt, priority))
        if isinstance(prompt, dict):  # the fake only knows text and token ids
            prompt = prompt.get("prompt_token_ids") or prompt["prompt"]
        before = len(stream.items) if stream is not None else 0
        stream = add(request_id, prompt, params, priority, stream)
        for out in stream.items[before:]:
            out.num_cached_tokens = CACHED_PER_PROMPT
        return stream

    fake_engine.add_request = add_request
    return seen


def _events(raw: bytes) -> list[dict]:
    parts = raw.decode().split("\n\n")[:-1]
    assert parts[-1] == "data: [DONE]"
    return [json.loads(p[len("data: "):]) for p in parts[:-1]]


def test_completion_salt_priority_and_cached_tokens(call, submitted):
    status, raw = call("POST", "/v1/completions", {"prompt": ["ab", "cde"], "max_tokens": 2,
                                                   "cache_salt": "tenant-1", "priority": 3})
    assert status == 200, raw
    body = json.loads(raw)
    assert [p for _, p, _ in submitted] == [{"prompt": "ab", "cache_salt": "tenant-1"},
                                            {"prompt": "cde", "cache_salt": "tenant-1"}]
    assert {prio for _, _, prio in submitted} == {3}
    assert body["usage"]["prompt_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * CACHED_PER_PROMPT}

    submitted.clear()
    status, raw = call("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "stream": True,
                                                   "stream_options": {"include_usage": True}})
    assert status == 200, raw
    assert submitted[0][1] == [5, 6, 7]  # no salt: the prompt goes as it came
    usage = _events(raw)[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": CACHED_PER_PROMPT}


def test_chat_salt_and_cached_tokens(call, submitted):
    msgs = [{"role": "user", "content": "hi"}]
    status, raw = call("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "cache_salt": "t2",
                                                        "priority": -1})
    assert status == 200, raw
    (_, prompt, prio), = submitted
    assert prompt["cache_salt"] == "t2" and isinstance(prompt["prompt_token_ids"], list) and prio == -1
    assert json.loads(raw)["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED_PER_PROMPT}

    status, raw = call("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert status == 200, raw
    assert _events(raw)[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": CACHED_PER_PROMPT}


def test_empty_cache_salt_is_a_400(call, submitted):
    status, raw = call("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2, "cache_salt": ""})
    assert status == 400, raw
    assert "cache_salt" in json.loads(raw)["error"]["message"] and not submitted
