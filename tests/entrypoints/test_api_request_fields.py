"""Request fields over HTTP on the fake engine: each reaches the engine or shapes the response; bad values are 400s.

The fake engine (fake_engine.py) tokenizes text as code points and gives
prompt position i the logprob -i, so echoed logprobs can be checked exactly.
lm-eval's loglikelihood body is sent as lm-eval sends it.
"""

from __future__ import annotations

import json
import logging

import pytest

C, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


def _ok(call, path, body):
    status, raw = call("POST", path, body)
    assert status == 200, raw
    return json.loads(raw)


def _error(call, path, body) -> str:
    status, raw = call("POST", path, body)
    assert status == 400, raw
    return json.loads(raw)["error"]["message"]


def _params(fake_engine):
    (_, params), = fake_engine.requests.values()
    return params


def test_sampling_fields_reach_the_engine(call, fake_engine):
    _ok(call, C, {"prompt": "abc", "max_tokens": 2, "bad_words": ["x y"], "prompt_logprobs": 2,
                  "truncate_prompt_tokens": 2, "allowed_token_ids": [1, 2], "logit_bias": {"3": 1.5},
                  "spaces_between_special_tokens": False, "skip_special_tokens": False,
                  "include_stop_str_in_output": True, "min_p": 0.1, "seed": 7})
    p = _params(fake_engine)
    assert (p.bad_words, p.prompt_logprobs, p.truncate_prompt_tokens) == (["x y"], 2, 2)
    assert (p.allowed_token_ids, p.logit_bias) == ([1, 2], {3: 1.5})
    assert not p.spaces_between_special_tokens and not p.skip_special_tokens and p.include_stop_str_in_output
    assert (p.min_p, p.seed) == (0.1, 7)


def test_lm_eval_loglikelihood_body_returns_the_prompt_logprobs(call, fake_engine):
    # lm_eval.models.openai_completions: echo + logprobs + max_tokens 1 (0 in older versions), temperature 0.
    for max_tokens in (1, 0):
        fake_engine.requests.clear()
        body = _ok(call, C, {"model": "fake-model", "prompt": "abcd", "echo": True, "logprobs": 1,
                             "max_tokens": max_tokens, "temperature": 0.0, "seed": 1234})
        assert _params(fake_engine).prompt_logprobs == 1 and _params(fake_engine).max_tokens == 1
        choice = body["choices"][0]
        lp = choice["logprobs"]
        n_gen = max_tokens  # echo with max_tokens 0: the prompt alone
        assert choice["text"] == "abcd" + " w0" * n_gen
        # The first prompt token has no logprob entry; its text is the tokenizer's decode (" w-3" here).
        first = fake_engine.tokenizer.decode([ord("a")])
        assert lp["tokens"][:4] == [first, "b", "c", "d"] and len(lp["tokens"]) == 4 + n_gen
        assert lp["token_logprobs"][:4] == [None, -1.0, -2.0, -3.0]
        assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"x": -0.25}
        offsets = [0, len(first), len(first) + 1, len(first) + 2]
        assert lp["text_offset"][:4] == offsets
        if n_gen:
            assert lp["token_logprobs"][4] == -0.5 and lp["text_offset"][4] == offsets[-1] + 1


def test_echo_logprobs_stream_first_chunk_carries_the_prompt(call, fake_engine):
    status, raw = call("POST", C, {"prompt": "abc", "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True})
    assert status == 200, raw
    events = [json.loads(e[len("data: "):]) for e in raw.decode().split("\n\n")[:-2]]
    first = events[0]["choices"][0]
    assert first["text"].startswith("abc")
    assert first["logprobs"]["token_logprobs"][:3] == [None, -1.0, -2.0]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == [fake_engine.tokenizer.decode([ord("a")]), "b", "c", " w0", " w1"]


def test_prompt_logprobs_field_on_both_endpoints(call):
    body = _ok(call, C, {"prompt": "ab", "max_tokens": 1, "prompt_logprobs": 1})
    assert body["choices"][0]["prompt_logprobs"] == [
        None, {"98": {"logprob": -1.0, "rank": 1, "decoded_token": "b"},
               "7": {"logprob": -0.25, "rank": 1, "decoded_token": "x"}}]
    chat = _ok(call, CHAT, {"messages": MSGS, "max_tokens": 1, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    assert _ok(call, C, {"prompt": "ab", "max_tokens": 1})["choices"][0]["prompt_logprobs"] is None


def test_return_tokens_as_token_ids(call):
    body = _ok(call, C, {"prompt": "ab", "max_tokens": 1, "echo": True, "logprobs": 1,
                         "return_tokens_as_token_ids": True})
    assert body["choices"][0]["logprobs"]["tokens"] == ["token_id:97", "token_id:98", "token_id:100"]
    chat = _ok(call, CHAT, {"messages": MSGS, "max_tokens": 1, "logprobs": True, "top_logprobs": 1,
                            "return_tokens_as_token_ids": True})
    content = chat["choices"][0]["logprobs"]["content"][0]
    assert content["token"] == "token_id:100" and content["top_logprobs"][0]["token"].startswith("token_id:")


def test_add_special_tokens_false_tokenizes_without_them(call, fake_engine):
    submitted = []
    inner = fake_engine.add_request
    fake_engine.add_request = lambda rid, prompt, *a, **k: (submitted.append(prompt), inner(rid, prompt, *a, **k))[1]
    _ok(call, C, {"prompt": "ab", "max_tokens": 1, "add_special_tokens": False})
    assert submitted == [{"prompt": "ab", "prompt_token_ids": [97, 98]}]


def test_chat_template_fields(call, fake_engine):
    docs = [{"title": "t", "text": "body"}]
    _ok(call, CHAT, {"messages": MSGS, "max_tokens": 1, "documents": docs, "chat_template_kwargs": {"x": 1}})
    assert fake_engine.template_kwargs == {"add_generation_prompt": True, "documents": docs, "x": 1,
                                           "sanitize_control_tokens": False}
    _ok(call, CHAT, {"messages": MSGS + [{"role": "assistant", "content": "so"}], "max_tokens": 1,
                     "continue_final_message": True, "add_generation_prompt": False})
    assert fake_engine.template_kwargs == {"add_generation_prompt": False, "continue_final_message": True,
                                           "sanitize_control_tokens": False}
    msg = _error(call, CHAT, {"messages": MSGS, "continue_final_message": True, "add_generation_prompt": True})
    assert "continue_final_message" in msg


@pytest.mark.parametrize(("path", "body", "words"), [
    (C, {"prompt": "ab", "prompt_logprobs": 6}, ["prompt_logprobs", "5", "--max-logprobs"]),
    (CHAT, {"messages": MSGS, "prompt_logprobs": 6}, ["prompt_logprobs", "--max-logprobs"]),
    (C, {"prompt": "ab", "truncate_prompt_tokens": 65}, ["truncate_prompt_tokens", "65", "64"]),
    (C, {"prompt": "ab", "truncate_prompt_tokens": -2}, ["truncate_prompt_tokens"]),
    (C, {"prompt": "ab", "bad_words": "word"}, ["bad_words"]),
    (C, {"prompt": "ab", "use_beam_search": True}, ["use_beam_search", "beam search"]),
    (C, {"prompt": "ab", "length_penalty": 0.5}, ["length_penalty"]),
    (C, {"prompt": "ab", "kv_transfer_params": {"a": 1}}, ["kv_transfer_params"]),
    (CHAT, {"messages": MSGS, "vllm_xargs": {"k": 1}}, ["vllm_xargs"]),
    (CHAT, {"messages": MSGS, "echo": True}, ["echo"]),
    (C, {"prompt": "ab", "prompt_embeds": "AAAA"}, ["prompt_embeds"]),
])
def test_bad_values_are_400_naming_the_field(call, path, body, words):
    msg = _error(call, path, body)
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize(("path", "body", "param"), [
    (C, {"prompt": "ab", "logprobs": 6}, "logprobs"),
    (C, {"prompt": "ab", "prompt_logprobs": 6}, "prompt_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
])
def test_max_logprobs_error_names_its_field_in_param(call, path, body, param):
    status, raw = call("POST", path, body)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and "--max-logprobs" in error["message"]


def test_unsupported_field_error_is_the_validators_sentence_with_its_param(call):
    """A field a validator refuses: the body's `param` names it and the message is the validator's own sentence
    (no pydantic "Value error, " prefix, no doubled period)."""
    status, raw = call("POST", C, {"prompt": "ab", "use_beam_search": True})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "use_beam_search"
    assert error["message"].startswith("The field `use_beam_search` is not supported: ")
    assert "Value error" not in error["message"] and not error["message"].endswith("..")


def test_neutral_values_of_unsupported_fields_are_accepted(call):
    _ok(call, C, {"prompt": "ab", "max_tokens": 1, "use_beam_search": False, "length_penalty": 1.0,
                  "kv_transfer_params": None, "vllm_xargs": {}})


def test_unknown_fields_accepted_and_logged_once_per_name(call, caplog):
    caplog.set_level(logging.INFO, logger="tokenmill.entrypoints.openai.request_fields")
    for _ in range(2):
        _ok(call, C, {"prompt": "ab", "max_tokens": 1, "frobnicate_level": 3, "guided_decoding_backend": "xgrammar"})
    warnings = [r for r in caplog.records if "frobnicate_level" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    ignored = [r for r in caplog.records if "guided_decoding_backend" in r.getMessage()]
    assert len(ignored) == 1 and "ignored" in ignored[0].getMessage()


def test_continuous_usage_stats(call):
    status, raw = call("POST", C, {"prompt": "ab", "max_tokens": 3, "stream": True,
                                   "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert status == 200, raw
    events = [json.loads(e[len("data: "):]) for e in raw.decode().split("\n\n")[:-2]]
    per_chunk = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert per_chunk == [1, 2, 3]
