"""Streams that fell behind: all queued outputs go out as one chunk per choice, with the same text and counts.

`FakeEngine.ready_group` makes the fake stream hand over several cumulative
outputs per `next_ready` (as `OutputStream.next_ready` does when its queue
holds several); the SSE body must carry exactly the tokens, text, logprobs
and usage of the one-output-at-a-time stream, in fewer chunks.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from fake_engine import fake_completion_text

from tokenmill.frontend.async_llm import OutputStream
from tokenmill.outputs import CompletionOutput, RequestOutput


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


class _Llm:
    def __init__(self) -> None:
        self._queues: dict = {}
        self.aborted: list[str] = []

    def abort_requests(self, ids: list[str]) -> None:
        self.aborted.extend(ids)


def _out(rid: str, k: int, done: bool = False) -> RequestOutput:
    return RequestOutput(rid, None, [1], [CompletionOutput(0, "x" * k, list(range(k)),
                                                           finish_reason="length" if done else None)], done)


def test_output_stream_next_ready_takes_the_queue_then_raises_a_queued_error():
    async def run() -> None:
        llm = _Llm()
        stream = OutputStream(llm)  # type: ignore[arg-type]
        stream.unfinished.update({"r", "s"})
        llm._queues.update({"r": stream.queue, "s": stream.queue})
        for item in (_out("r", 1), _out("s", 1), _out("r", 2, done=True), ValueError("bad"), _out("s", 2)):
            stream.queue.put_nowait(item)
        first = await stream.next_ready()
        assert [(o.request_id, len(o.outputs[0].token_ids)) for o in first] == [("r", 1), ("s", 1), ("r", 2)]
        assert stream.unfinished == {"s"} and "r" not in llm._queues
        with pytest.raises(ValueError, match="bad"):
            await stream.next_ready()  # the error queued after those outputs, not before
        rest = await stream.next_ready()
        assert [o.request_id for o in rest] == ["s"]
        stream.close()
        assert llm.aborted == ["s"]

    asyncio.run(run())
