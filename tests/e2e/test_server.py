"""End to end: a real `tokenmill serve` process with the bundled SmolLM2, driven by the real `openai` client.

Uses the session's `agent_server` (conftest.py: --max-model-len 1024, no API
key; its tool flags play no part in requests without tools). Everything goes
to 127.0.0.1 on a free port. Generation lengths are kept short: the suite runs
on 2 CPU cores.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest
from optional_deps import require
from server_harness import AGENT_MAX_MODEL_LEN, http, no_keepalive

openai = require("openai")

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(agent_server):
    return openai.OpenAI(base_url=f"{agent_server.base}/v1", api_key="unused",
                         http_client=no_keepalive(), max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from tokenmill.model_loader.tokenizer import load_tokenizer
    from tokenmill.model_loader.source import bundled_gguf_path

    return load_tokenizer(bundled_gguf_path())


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_paris(client, model):
    reply = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant"
    u = reply.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_chat_stream_equals_non_stream(client, model):
    full = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=24)
    stream = client.chat.completions.create(model=model, messages=CAPITAL, temperature=0, max_tokens=24,
                                            stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_equals_non_stream(client, model, tokenizer):
    prompt = "The three primary colors are"
    full = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=16)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=16, stream=True) if c.choices)
    assert text == full.choices[0].text and text
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_stop_string_cuts_the_text_the_same_way_in_both_modes(client, model):
    kwargs = {"model": model, "messages": CAPITAL, "temperature": 0, "max_tokens": 24, "stop": ["Paris"]}
    full = client.chat.completions.create(**kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                   if c.choices)
    assert full.choices[0].finish_reason == "stop"
    assert "Paris" not in full.choices[0].message.content and full.choices[0].message.content
    assert text == full.choices[0].message.content


def test_n_choices_with_a_seed(client, model):
    res = client.completions.create(model=model, prompt="My favourite animal is", max_tokens=5, n=3, seed=1,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in res.choices) == [0, 1, 2]
    assert res.usage.completion_tokens == 15


def test_32_concurrent_requests_are_batched_with_correct_usage(client, model, agent_server, tokenizer):
    prompts = [f"Request {i}: write a number between {i} and {i + 100}:" for i in range(32)]
    max_tokens = 6

    def one(prompt: str):
        return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.8,
                                         seed=7, logprobs=0, extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(one, prompts))
    for prompt, res in zip(prompts, results):
        choice = res.choices[0]
        assert choice.finish_reason == "length"
        assert res.usage.completion_tokens == max_tokens == len(choice.logprobs.tokens)
        assert res.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert res.usage.total_tokens == res.usage.prompt_tokens + max_tokens
    status, raw, _ = http("GET", f"{agent_server.base}/stats")
    stats = json.loads(raw)
    assert status == 200 and stats["max_num_running_reqs"] > 1, stats


def test_dropped_stream_is_aborted_in_the_core(client, model, agent_server):
    stream = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    for got, _chunk in enumerate(stream, start=1):
        if got >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = json.loads(http("GET", f"{agent_server.base}/stats")[1])
        if stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0, stats


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", {"messages": CAPITAL, "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": CAPITAL, "top_p": 0}, 400),
    ("/v1/chat/completions", {"messages": CAPITAL, "top_p": 1.5}, 400),
    ("/v1/chat/completions", {"messages": CAPITAL, "n": 0}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": CAPITAL, "max_tokens": 10 * AGENT_MAX_MODEL_LEN}, 400),
    ("/v1/chat/completions", {"messages": CAPITAL, "max_tokens": "lots"}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": [999999999]}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, 400),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404),
    ("/v1/chat/completions", {"messages": CAPITAL, "model": "no-such-model"}, 404),
    ("/v1/completions", b'{"prompt": "unterminated', 400),
])
def test_errors_have_openai_bodies_and_server_survives(agent_server, model, path, body, status):
    raw_body = body if isinstance(body, bytes) else json.dumps(body).encode()
    got, raw, _ = http("POST", f"{agent_server.base}{path}", raw_body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    ok, raw, _ = http("POST", f"{agent_server.base}/v1/completions",
                    json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2}).encode())
    assert ok == 200 and json.loads(raw)["usage"]["completion_tokens"] > 0


def test_openai_client_raises_typed_errors(client, model):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=CAPITAL, temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CAPITAL)
