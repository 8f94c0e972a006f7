"""The HTTP layer over a fake engine: routes, usage, SSE framing, error bodies and status codes."""

from __future__ import annotations

import json

import pytest
from fake_engine import fake_completion_text


def _json(raw: bytes):
    return json.loads(raw.decode())


def _sse_events(raw: bytes) -> list[str]:
    """Split an SSE body into its `data:` payloads, checking the framing on the way."""
    text = raw.decode()
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = text.split("\n\n")[:-1]
    payloads = []
    for ev in events:
        assert ev.startswith("data: "), ev
        payloads.append(ev[len("data: "):])
    return payloads


def _assert_error(status: int, raw: bytes, want_status: int) -> dict:
    assert status == want_status, raw
    body = _json(raw)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_health_models_and_stats(call, fake_engine):
    status, raw = call("GET", "/health")
    assert status == 200
    status, raw = call("GET", "/v1/models")
    assert status == 200 and [m["id"] for m in _json(raw)["data"]] == ["fake-model"]
    status, raw = call("GET", "/stats")
    assert status == 200 and _json(raw)["max_num_running_reqs"] == 5
    fake_engine.healthy = False
    status, raw = call("GET", "/health")
    _assert_error(status, raw, 503)


def test_completion_usage_counts(call, fake_engine):
    status, raw = call("POST", "/v1/completions", {"model": "fake-model", "prompt": "hello", "max_tokens": 4})
    assert status == 200, raw
    body = _json(raw)
    assert body["object"] == "text_completion" and body["model"] == "fake-model"
    assert body["choices"][0]["text"] == fake_completion_text(4)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_batched_prompts_and_n_number_choices(call):
    status, raw = call("POST", "/v1/completions", {"prompt": ["ab", "cde"], "max_tokens": 2, "n": 2})
    assert status == 200, raw
    body = _json(raw)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    # Prompt tokens count once per prompt; completion tokens once per choice.
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_completion_logprobs_shape(call):
    status, raw = call("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 3, "logprobs": 1})
    assert status == 200, raw
    lp = _json(raw)["choices"][0]["logprobs"]
    assert lp["tokens"] == [" w0", " w1", " w2"]
    assert lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["text_offset"] == [0, 3, 6]
    assert all(len(t) == 1 for t in lp["top_logprobs"])


def test_chat_non_streaming_and_streaming_agree(call, fake_engine):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, raw = call("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 3})
    assert status == 200, raw
    full = _json(raw)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": fake_completion_text(3)}
    prompt_len = len("system: be brief\nuser: hi\nassistant:")
    assert full["usage"]["prompt_tokens"] == prompt_len and full["usage"]["completion_tokens"] == 3

    status, raw = call("POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "stream": True,
                                                        "stream_options": {"include_usage": True}})
    assert status == 200
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    # Usage rides alone on the last chunk, with empty choices.
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in c or c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_usage_on_every_chunk(call, route):
    body = {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body.update({"prompt": "ab"} if "chat" not in route else {"messages": [{"role": "user", "content": "hi"}]})
    status, raw = call("POST", route, body)
    assert status == 200, raw
    chunks = [json.loads(e) for e in _sse_events(raw)[:-1]]
    assert all(c.get("usage") for c in chunks), chunks
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 3  # cumulative, ending at the total
    content = [c for c in chunks if c["choices"] and (c["choices"][0].get("text") or
                                                      (c["choices"][0].get("delta") or {}).get("content"))]
    assert content and content[-1]["usage"]["completion_tokens"] == 3


def test_completion_stream_without_usage_has_no_usage_chunk(call):
    status, raw = call("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2, "stream": True})
    assert status == 200
    events = _sse_events(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and all(c["choices"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == fake_completion_text(2)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.01}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "", "max_tokens": 2}, None),
    ({"prompt": "x", "max_tokens": 1000}, None),  # beyond max_model_len 64
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": "x", "logprobs": 50}, None),  # above --max-logprobs 5
    ({"prompt": "x", "seed": 2**70}, "seed"),
])
def test_bad_completion_requests_are_400(call, body, param):
    status, raw = call("POST", "/v1/completions", body)
    err = _assert_error(status, raw, 400)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def test_bad_chat_requests_are_400(call):
    status, raw = call("POST", "/v1/chat/completions", {"messages": []})
    _assert_error(status, raw, 400)
    status, raw = call("POST", "/v1/chat/completions", {"messages": "hello"})
    _assert_error(status, raw, 400)


def test_invalid_json_is_400_not_422(call):
    status, raw = call("POST", "/v1/completions", b'{"prompt": "x",')
    err = _assert_error(status, raw, 400)
    assert "JSON" in err["message"]


def test_unknown_model_is_404(call):
    status, raw = call("POST", "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user",
                                                                                         "content": "x"}]})
    err = _assert_error(status, raw, 404)
    assert "gpt-9" in err["message"] and err["param"] == "model"


def test_unexpected_engine_error_is_500_and_server_keeps_serving(call):
    status, raw = call("POST", "/v1/completions", {"prompt": "boom"})
    err = _assert_error(status, raw, 500)
    assert "simulated engine bug" in err["message"]
    status, raw = call("POST", "/v1/completions", {"prompt": "fine", "max_tokens": 1})
    assert status == 200


def test_abandoned_stream_aborts_its_request(app, fake_engine):
    import asyncio

    from tokenmill.entrypoints.openai.protocol import CompletionRequest
    from tokenmill.entrypoints.openai.serving_completion import OpenAIServingCompletion

    serving = OpenAIServingCompletion(fake_engine, ["fake-model"])

    async def run() -> None:
        req = CompletionRequest(prompt="ab", max_tokens=5, stream=True, request_id="r1")
        rid, model, sub = serving.start(req)
        gen = serving.stream_response(req, rid, model, sub)
        await gen.__anext__()  # one chunk, then the client goes away
        await gen.aclose()

    asyncio.run(run())
    assert fake_engine.aborted == ["r1"]


def test_engine_death_mid_stream_sends_an_error_event_then_done(call):
    status, raw = call("POST", "/v1/completions", {"prompt": "die", "max_tokens": 4, "stream": True})
    assert status == 200  # the headers had gone out before the failure
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == 503 and "core process exited" in last["error"]["message"]
    status, raw = call("POST", "/v1/completions", {"prompt": "die", "max_tokens": 4})
    _assert_error(status, raw, 503)


def test_echo_prepends_the_prompt_text_or_decoded_ids(call):
    status, raw = call("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2, "echo": True})
    assert status == 200 and _json(raw)["choices"][0]["text"] == "ab" + fake_completion_text(2)
    status, raw = call("POST", "/v1/completions", {"prompt": [100, 101], "max_tokens": 1, "echo": True})
    assert status == 200 and _json(raw)["choices"][0]["text"] == " w0 w1" + fake_completion_text(1)
    status, raw = call("POST", "/v1/completions", {"prompt": "ab", "max_tokens": 2, "echo": True, "stream": True})
    chunks = [json.loads(e) for e in _sse_events(raw)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ab" + fake_completion_text(2)


def test_client_disconnect_aborts_a_non_streaming_request(app, fake_engine):
    import asyncio

    from fake_engine import _scope

    body = json.dumps({"prompt": "hang", "max_tokens": 3, "request_id": "slow-1"}).encode()
    sent: list[dict] = []

    async def run() -> None:
        calls = 0

        async def receive():
            nonlocal calls
            calls += 1
            if calls == 1:
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(0.05)  # the client hangs up while the engine works
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(_scope("POST", "/v1/completions"), receive, send), timeout=10)

    asyncio.run(run())
    assert fake_engine.aborted == ["slow-1"]
