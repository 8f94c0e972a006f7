"""Request fields against the real server (the shared `prod_server`: SmolLM2, --max-model-len 256, --max-logprobs 20).

lm-eval's loglikelihood body returns the prompt tokens' logprobs, bad_words
removes a word greedy decoding produces, truncate_prompt_tokens keeps the
last N tokens, and the bad values that need the real tokenizer or limits are
400s with a message.
"""

from __future__ import annotations

import json

import pytest
from server_harness import API_KEY, PROD_MAX_MODEL_LEN, http

pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"


def _post(srv, path: str, body: dict) -> tuple[int, dict]:
    status, raw, _ = http("POST", f"{srv.base}{path}", body, AUTH)
    return status, json.loads(raw)


def _ok(srv, path: str, body: dict) -> dict:
    status, out = _post(srv, path, body)
    assert status == 200, out
    return out


def _ids(srv, text: str) -> list[int]:
    return _ok(srv, "/tokenize", {"prompt": text})["tokens"]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request_returns_prompt_logprobs(prod_server, max_tokens):
    ids = _ids(prod_server, PROMPT + " Paris")
    # lm_eval.models.openai_completions (local-completions): token-id prompts, echo, logprobs 1.
    body = {"prompt": [ids], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1, "seed": 1234, "echo": True}
    lp = _ok(prod_server, "/v1/completions", body)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + max_tokens
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v < 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][: len(ids)]) == PROMPT + " Paris"
    assert lp["text_offset"][: len(ids)] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    # The same numbers as the prompt_logprobs field: " Paris" is the model's top choice after the prompt.
    plp = _ok(prod_server, "/v1/completions", {"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 1})
    positions = plp["choices"][0]["prompt_logprobs"]
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(positions[i][str(ids[i])]["logprob"], abs=1e-5)
    assert positions[-1][str(ids[-1])]["rank"] == 1
    assert max(lp["top_logprobs"][len(ids) - 1], key=lp["top_logprobs"][len(ids) - 1].get) == " Paris"


def test_bad_words_remove_the_greedy_word(prod_server):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    assert "Paris" in _ok(prod_server, "/v1/completions", body)["choices"][0]["text"]
    text = _ok(prod_server, "/v1/completions", {**body, "bad_words": ["Paris"]})["choices"][0]["text"]
    assert "Paris" not in text
    chat = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12,
            "temperature": 0}
    assert "Paris" in _ok(prod_server, "/v1/chat/completions", chat)["choices"][0]["message"]["content"]
    reply = _ok(prod_server, "/v1/chat/completions", {**chat, "bad_words": ["Paris"]})
    assert "Paris" not in reply["choices"][0]["message"]["content"]


def test_truncate_prompt_tokens_keeps_the_last_n(prod_server):
    text = "one two three four five six seven"
    ids = _ids(prod_server, text)
    out = _ok(prod_server, "/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 3,
                                               "echo": True, "temperature": 0})
    assert out["usage"]["prompt_tokens"] == 3
    kept = _ok(prod_server, "/detokenize", {"tokens": ids[-3:]})["prompt"]
    assert out["choices"][0]["text"].startswith(kept) and kept == " five six seven"
    same = _ok(prod_server, "/v1/completions", {"prompt": ids[-3:], "max_tokens": 1, "temperature": 0})
    assert out["choices"][0]["text"] == kept + same["choices"][0]["text"]


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/v1/completions", {"prompt": PROMPT, "bad_words": ["Paris", "   "]}, ["bad_words", "tokenizes to no tokens"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "bad_words": [""]},
     ["bad_words", "tokenizes to no tokens"]),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, ["prompt_logprobs", "20", "--max-logprobs"]),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 21}, ["20", "--max-logprobs"]),
    ("/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": PROD_MAX_MODEL_LEN + 1},
     ["truncate_prompt_tokens", str(PROD_MAX_MODEL_LEN + 1), str(PROD_MAX_MODEL_LEN)]),
    ("/v1/completions", {"prompt": PROMPT, "use_beam_search": True}, ["use_beam_search"]),
])
def test_bad_field_values_are_400_with_a_message(prod_server, path, body, words):
    status, out = _post(prod_server, path, body)
    assert status == 400, out
    for w in words:
        assert w in out["error"]["message"], out
