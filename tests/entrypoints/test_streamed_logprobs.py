"""Streams carry one logprob entry per generated token, also for tokens that add no text.

The fake engine below holds back the text of every other token (as the real
detokenizer does for skipped special tokens and the first bytes of a
multi-byte character); the streamed logprobs must still match the
non-streamed ones entry for entry.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import FakeEngine, FakeStream, asgi_call, fake_completion_text

from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind

NUM_TOKENS = 7


class LaggingTextEngine(FakeEngine):
    """Like FakeEngine, but a running output's text only grows every second token."""

    def add_request(self, request_id, prompt, params, priority=0, stream=None):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        stream = stream or FakeStream(self)
        stream.unfinished.add(request_id)
        n = params.max_tokens
        steps = [n] if params.output_kind == RequestOutputKind.FINAL_ONLY else range(1, n + 1)
        for k in steps:
            done = k == n
            shown = k if done else k // 2 * 2
            logprobs = [{100 + i: Logprob(-0.25 * (i + 1), 1, f" w{i}")} for i in range(k)]
            comp = CompletionOutput(index=0, text=fake_completion_text(shown), token_ids=list(range(100, 100 + k)),
                                    logprobs=logprobs, finish_reason="length" if done else None)
            stream.push(RequestOutput(request_id, None, ids, [comp], done), params.output_kind)
        return stream


@pytest.fixture
def lagging_call():
    from tokenmill.entrypoints.openai.api_server import build_app

    app = build_app(LaggingTextEngine(), ["fake-model"], max_logprobs=5)
    return lambda path, body: asyncio.run(asgi_call(app, "POST", path, body))


def _chunks(raw: bytes) -> list[dict]:
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_stream_has_one_logprob_per_token(lagging_call):
    body = {"prompt": "ab", "max_tokens": NUM_TOKENS, "logprobs": 1, "temperature": 0}
    status, raw = lagging_call("/v1/completions", body)
    assert status == 200, raw
    full = json.loads(raw)["choices"][0]
    status, raw = lagging_call("/v1/completions", {**body, "stream": True})
    chunks = _chunks(raw)
    tokens, logprobs, text = [], [], ""
    for c in chunks:
        choice = c["choices"][0]
        text += choice["text"]
        tokens += choice["logprobs"]["tokens"]
        logprobs += choice["logprobs"]["token_logprobs"]
    assert tokens == full["logprobs"]["tokens"] == [f" w{i}" for i in range(NUM_TOKENS)]
    assert logprobs == full["logprobs"]["token_logprobs"]
    assert text == full["text"]
    # Tokens whose text was held back still made chunks (with empty text).
    assert any(c["choices"][0]["text"] == "" and c["choices"][0]["logprobs"]["tokens"] for c in chunks)


def test_chat_stream_has_one_logprob_per_token(lagging_call):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": NUM_TOKENS, "logprobs": True,
            "top_logprobs": 1, "temperature": 0}
    status, raw = lagging_call("/v1/chat/completions", body)
    assert status == 200, raw
    full = json.loads(raw)["choices"][0]
    status, raw = lagging_call("/v1/chat/completions", {**body, "stream": True})
    entries, text = [], ""
    for c in _chunks(raw):
        choice = c["choices"][0]
        text += choice["delta"].get("content") or ""
        if choice["logprobs"]:
            entries += choice["logprobs"]["content"]
    assert [(e["token"], e["logprob"], e["bytes"]) for e in entries] == \
        [(e["token"], e["logprob"], e["bytes"]) for e in full["logprobs"]["content"]]
    assert len(entries) == NUM_TOKENS and text == full["message"]["content"]
