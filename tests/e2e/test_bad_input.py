"""Malformed, out-of-range and hostile requests against the real server: each gets a 4xx with an error body.

After every case the same server must still answer a normal request. Uses
the session's `prod_server` (conftest.py: --max-model-len 256, --max-num-seqs
64, --max-logprobs 20, 1 MiB body limit, an API key).
"""

from __future__ import annotations

import json

import pytest
from server_harness import API_KEY, PROD_MAX_BODY_BYTES, PROD_MAX_MODEL_LEN, PROD_MAX_NUM_SEQS, http

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MSGS = [{"role": "user", "content": "Hi"}]
C, CHAT, TOK, DETOK, OLLAMA = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/api/chat"

# (id, method, path, body (dict / bytes), extra headers, expected status)
CASES = [
    # wrong types
    ("prompt-int", "POST", C, {"prompt": 5}, {}, 400),
    ("prompt-dict", "POST", C, {"prompt": {"a": 1}}, {}, 400),
    ("prompt-mixed-list", "POST", C, {"prompt": ["a", 1]}, {}, 400),
    ("max-tokens-string", "POST", C, {"prompt": "Hi", "max_tokens": "ten"}, {}, 400),
    ("max-tokens-float", "POST", C, {"prompt": "Hi", "max_tokens": 2.5}, {}, 400),
    ("temperature-string", "POST", C, {"prompt": "Hi", "temperature": "hot"}, {}, 400),
    ("stream-string", "POST", C, {"prompt": "Hi", "stream": "maybe"}, {}, 400),
    ("stop-int", "POST", C, {"prompt": "Hi", "stop": 5}, {}, 400),
    ("stop-token-ids-strings", "POST", C, {"prompt": "Hi", "stop_token_ids": ["a"]}, {}, 400),
    ("logit-bias-list", "POST", C, {"prompt": "Hi", "logit_bias": [1, 2]}, {}, 400),
    ("messages-string", "POST", CHAT, {"messages": "Hi"}, {}, 400),
    ("message-without-role", "POST", CHAT, {"messages": [{"content": "Hi"}]}, {}, 400),
    ("user-int", "POST", CHAT, {"messages": MSGS, "user": 5}, {}, 400),
    ("body-array", "POST", C, [], {}, 400),
    ("body-null", "POST", C, b"null", {}, 400),
    # missing fields
    ("no-prompt", "POST", C, {"max_tokens": 2}, {}, 400),
    ("no-messages", "POST", CHAT, {"max_tokens": 2}, {}, 400),
    ("empty-body", "POST", C, b"", {}, 400),
    # empty values
    ("prompt-empty-string", "POST", C, {"prompt": ""}, {}, 400),
    ("prompt-empty-list", "POST", C, {"prompt": []}, {}, 400),
    ("prompt-empty-inner-list", "POST", C, {"prompt": [[]]}, {}, 400),
    ("messages-empty", "POST", CHAT, {"messages": []}, {}, 400),
    ("stop-empty-string", "POST", C, {"prompt": "Hi", "stop": [""]}, {}, 400),
    ("allowed-token-ids-empty", "POST", C, {"prompt": "Hi", "allowed_token_ids": []}, {}, 400),
    # negative and out-of-range values
    ("max-tokens-zero", "POST", C, {"prompt": "Hi", "max_tokens": 0}, {}, 400),
    ("max-tokens-negative", "POST", C, {"prompt": "Hi", "max_tokens": -5}, {}, 400),
    ("max-completion-tokens-negative", "POST", CHAT, {"messages": MSGS, "max_completion_tokens": -1}, {}, 400),
    ("temperature-negative", "POST", C, {"prompt": "Hi", "temperature": -0.5}, {}, 400),
    ("top-p-zero", "POST", C, {"prompt": "Hi", "top_p": 0}, {}, 400),
    ("top-p-above-one", "POST", C, {"prompt": "Hi", "top_p": 1.5}, {}, 400),
    ("top-k-minus-two", "POST", C, {"prompt": "Hi", "top_k": -2}, {}, 400),
    ("min-p-two", "POST", C, {"prompt": "Hi", "min_p": 2}, {}, 400),
    ("presence-penalty-three", "POST", C, {"prompt": "Hi", "presence_penalty": 3}, {}, 400),
    ("frequency-penalty-minus-three", "POST", CHAT, {"messages": MSGS, "frequency_penalty": -3}, {}, 400),
    ("repetition-penalty-zero", "POST", C, {"prompt": "Hi", "repetition_penalty": 0}, {}, 400),
    ("min-tokens-negative", "POST", C, {"prompt": "Hi", "min_tokens": -1}, {}, 400),
    ("min-tokens-above-max", "POST", C, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}, {}, 400),
    ("n-zero", "POST", C, {"prompt": "Hi", "n": 0}, {}, 400),
    ("n-negative", "POST", CHAT, {"messages": MSGS, "n": -3}, {}, 400),
    ("stop-token-id-negative", "POST", C, {"prompt": "Hi", "stop_token_ids": [-1]}, {}, 400),
    ("logit-bias-too-strong", "POST", C, {"prompt": "Hi", "logit_bias": {"5": 1000}}, {}, 400),
    ("logit-bias-not-a-token", "POST", C, {"prompt": "Hi", "logit_bias": {"abc": 1}}, {}, 400),
    ("logprobs-negative", "POST", C, {"prompt": "Hi", "logprobs": -1}, {}, 400),
    ("top-logprobs-without-logprobs", "POST", CHAT, {"messages": MSGS, "top_logprobs": 3}, {}, 400),
    ("priority-huge", "POST", C, {"prompt": "Hi", "priority": 2**40}, {}, 400),
    # huge values
    ("max-tokens-huge", "POST", C, {"prompt": "Hi", "max_tokens": 10**30}, {}, 400),
    ("max-tokens-above-context", "POST", CHAT, {"messages": MSGS, "max_tokens": 10 * PROD_MAX_MODEL_LEN}, {}, 400),
    ("n-above-max-num-seqs", "POST", C, {"prompt": "Hi", "max_tokens": 1, "n": PROD_MAX_NUM_SEQS + 1}, {}, 400),
    ("n-huge", "POST", C, {"prompt": "Hi", "n": 10**9}, {}, 400),
    ("top-k-huge", "POST", C, {"prompt": "Hi", "top_k": 2**62}, {}, 400),
    ("min-tokens-huge", "POST", C, {"prompt": "Hi", "min_tokens": 2**62}, {}, 400),
    ("seed-above-64-bits", "POST", C, {"prompt": "Hi", "seed": 2**70}, {}, 400),
    ("logprobs-above-max", "POST", C, {"prompt": "Hi", "logprobs": 21}, {}, 400),
    ("top-logprobs-above-max", "POST", CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 10**6}, {}, 400),
    ("stop-token-id-huge", "POST", C, {"prompt": "Hi", "stop_token_ids": [2**63]}, {}, 400),
    ("allowed-token-out-of-vocab", "POST", C, {"prompt": "Hi", "allowed_token_ids": [10**6]}, {}, 400),
    ("logit-bias-out-of-vocab", "POST", C, {"prompt": "Hi", "logit_bias": {"99999999": 1}}, {}, 400),
    ("prompt-token-out-of-vocab", "POST", C, {"prompt": [999999999]}, {}, 400),
    ("prompt-token-negative", "POST", C, {"prompt": [-1, 5]}, {}, 400),
    ("temperature-nan", "POST", C, b'{"prompt": "Hi", "temperature": NaN}', {}, 400),
    ("top-p-infinity", "POST", C, b'{"prompt": "Hi", "top_p": Infinity}', {}, 400),
    ("logit-bias-nan", "POST", C, b'{"prompt": "Hi", "logit_bias": {"5": NaN}}', {}, 400),
    # huge prompts and bodies
    ("prompt-longer-than-context", "POST", C, {"prompt": "hello " * (2 * PROD_MAX_MODEL_LEN)}, {}, 400),
    ("prompt-ids-fill-context", "POST", C, {"prompt": [100] * PROD_MAX_MODEL_LEN}, {}, 400),
    ("chat-longer-than-context", "POST", CHAT, {"messages": [{"role": "user", "content": "hi " * 2000}]}, {}, 400),
    ("body-over-limit", "POST", C, {"prompt": "x" * (PROD_MAX_BODY_BYTES + 10)}, {}, 413),
    ("batch-of-too-many-sequences", "POST", C, {"prompt": ["a"] * 100, "n": 50, "max_tokens": 1}, {}, 400),
    # invalid JSON and content types
    ("json-truncated", "POST", C, b'{"prompt": "unterminated', {}, 400),
    ("json-garbage", "POST", CHAT, b"\x00\xff not json", {}, 400),
    ("content-type-text", "POST", C, b'{"prompt": "Hi"}', {"Content-Type": "text/plain"}, 415),
    ("content-type-form", "POST", CHAT, b"messages=hi", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    # unknown models, routes and methods, unsupported options
    ("unknown-model-completions", "POST", C, {"prompt": "Hi", "model": "gpt-9"}, {}, 404),
    ("unknown-model-chat", "POST", CHAT, {"messages": MSGS, "model": "gpt-9"}, {}, 404),
    ("unknown-model-ollama", "POST", OLLAMA, {"model": "llama9", "messages": MSGS}, {}, 404),
    ("unknown-route", "POST", "/v1/nope", {"prompt": "Hi"}, {}, 404),
    ("wrong-method", "GET", C, None, {}, 405),
    ("suffix", "POST", C, {"prompt": "Hi", "suffix": "end"}, {}, 400),
    ("best-of", "POST", C, {"prompt": "Hi", "best_of": 3}, {}, 400),
    ("image-content", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, 400),
    ("response-format-bogus", "POST", CHAT, {"messages": MSGS, "response_format": {"type": "bogus"}}, {}, 400),
    ("tokenize-both", "POST", TOK, {"prompt": "Hi", "messages": MSGS}, {}, 400),
    ("tokenize-neither", "POST", TOK, {}, {}, 400),
    ("detokenize-out-of-vocab", "POST", DETOK, {"tokens": [-1]}, {}, 400),
    ("ollama-num-ctx-zero", "POST", OLLAMA, {"messages": MSGS, "options": {"num_ctx": 0}}, {}, 400),
    ("ollama-num-predict-string", "POST", OLLAMA, {"messages": MSGS, "options": {"num_predict": "x"}}, {}, 400),
    ("ollama-images", "POST", OLLAMA, {"messages": [{"role": "user", "content": "Hi", "images": ["aGk="]}]}, {}, 400),
]


def _error_message(raw: bytes) -> str:
    body = json.loads(raw)
    err = body["error"]
    if isinstance(err, str):  # Ollama's shape
        return err
    assert set(err) == {"message", "type", "param", "code"}
    return err["message"]


def test_the_table_is_big_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_4xx_with_an_error_body_then_the_server_still_serves(prod_server, case):
    _, method, path, body, headers, expected = case
    status, raw, _ = http(method, f"{prod_server.base}{path}", body, {**AUTH, **headers})
    assert status == expected, raw[:500]
    assert _error_message(raw)
    ok, raw, _ = http("POST", f"{prod_server.base}/v1/completions", {"prompt": "Hello", "max_tokens": 1}, AUTH)
    assert ok == 200 and json.loads(raw)["usage"]["completion_tokens"] == 1
