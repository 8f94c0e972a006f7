"""Ollama's API end to end, driven by the official `ollama` Python client (plus raw NDJSON checks).

Uses the session's `prod_server` (conftest.py), so every call carries the API
key as Ollama clients send headers: `Client(host, headers={...})`.
"""

from __future__ import annotations

import json

import pytest
from optional_deps import require
from server_harness import API_KEY, http

ollama = require("ollama")

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
OPTIONS = {"temperature": 0, "num_predict": 8, "top_k": 40, "top_p": 0.9, "seed": 3, "repeat_penalty": 1.0,
           "num_ctx": 256}


@pytest.fixture(scope="module")
def client(prod_server):
    # No kept-alive connections (server_harness.no_keepalive says why); `limits` goes to its httpx client.
    import httpx

    return ollama.Client(host=prod_server.base, headers=AUTH, limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module")
def model(prod_server):
    _, raw, _ = http("GET", f"{prod_server.base}/v1/models", headers=AUTH)
    return json.loads(raw)["data"][0]["id"]


def test_tags_ps_show_and_version_describe_the_served_model(client, model):
    names = [m.model for m in client.list().models]
    assert names == [f"{model}:latest"]
    assert [m.model for m in client.ps().models] == [f"{model}:latest"]
    shown = client.show(model)
    assert shown.details.family == "llama" and shown.details.format == "gguf"
    assert "im_start" in shown.template  # SmolLM2's chat template
    assert shown.modelinfo[f"{shown.details.family}.context_length"] == 256


def test_chat_non_streaming_with_options(client, model):
    res = client.chat(model=model, messages=CAPITAL, options=OPTIONS, stream=False)
    assert res.done and res.done_reason in ("stop", "length")
    assert "Paris" in res.message.content and res.message.role == "assistant"
    assert 0 < res.eval_count <= 8 and res.prompt_eval_count > 5
    assert res.total_duration >= res.eval_duration > 0


def test_chat_streaming_equals_non_streaming(client, model):
    full = client.chat(model=model, messages=CAPITAL, options=OPTIONS, stream=False)
    parts = list(client.chat(model=f"{model}:latest", messages=CAPITAL, options=OPTIONS, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == full.message.content
    assert parts[-1].eval_count == full.eval_count and parts[-1].done_reason == full.done_reason


def test_num_predict_stop_and_num_ctx_bound_the_output(client, model):
    short = client.chat(model=model, messages=CAPITAL, options={**OPTIONS, "num_predict": 2}, stream=False)
    assert short.eval_count == 2 and short.done_reason == "length"
    stopped = client.chat(model=model, messages=CAPITAL, options={**OPTIONS, "stop": ["Paris"]}, stream=False)
    assert "Paris" not in stopped.message.content and stopped.done_reason == "stop"
    prompt_len = short.prompt_eval_count
    tight = client.chat(model=model, messages=CAPITAL, options={**OPTIONS, "num_predict": -1, "num_ctx": prompt_len + 3},
                        stream=False)
    assert tight.eval_count <= 3


def test_generate_streams_ndjson_lines(prod_server, model):
    body = {"model": model, "prompt": "The capital of France is", "raw": True, "options": OPTIONS}
    status, raw, headers = http("POST", f"{prod_server.base}/api/generate", body, AUTH)
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert lines[-1]["done"] is True and all(not x["done"] for x in lines[:-1])
    text = "".join(x["response"] for x in lines)
    assert "Paris" in text and lines[-1]["eval_count"] <= 8
    assert all(x["model"] == model and x["created_at"].endswith("Z") for x in lines)


def test_unsupported_model_management_says_so(client, model):
    for call in (lambda: client.pull(model), lambda: client.delete(model)):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 501 and "not supported" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="no-such-model", messages=CAPITAL)
    assert info.value.status_code == 404
