"""InputProcessor: prompt forms, validation sentences, max_tokens and generation-config defaults."""

from __future__ import annotations

import pytest

from tokenmill.frontend.input_processor import InputProcessor, get_default_sampling_kwargs, get_prompt_text
from tokenmill.sampling_params import SamplingParams


@pytest.fixture
def proc(tokenizer, make_model_config):
    return InputProcessor(make_model_config(max_model_len=64), tokenizer)


def test_prompt_forms_agree(proc, tokenizer):
    ids = tokenizer.encode("Hello there")
    sp = SamplingParams(max_tokens=4)
    reqs = [proc.process(str(i), p, sp) for i, p in
            enumerate(["Hello there", ids, {"prompt": "Hello there"}, {"prompt_token_ids": ids}])]
    assert all(r.prompt_token_ids == ids for r in reqs)
    assert get_prompt_text({"prompt_token_ids": ids}) is None and get_prompt_text({"prompt": "x"}) == "x"


def test_params_cloned_max_tokens_filled_eos_added(proc):
    sp = SamplingParams(max_tokens=None)
    req = proc.process("r", [5, 6, 7], sp)
    assert req.sampling_params.max_tokens == 64 - 3
    assert sp.max_tokens is None  # the caller's object is untouched
    assert req.sampling_params.eos_token_id == 2 and 2 in req.sampling_params.all_stop_token_ids


def test_generation_config_eos_ids_become_stop_ids(tokenizer, make_model_config):
    proc = InputProcessor(make_model_config(generation_config={"eos_token_id": [2, 7]}), tokenizer)
    req = proc.process("r", [5], SamplingParams(max_tokens=2))
    assert {2, 7} <= req.sampling_params.all_stop_token_ids
    req = proc.process("r2", [5], SamplingParams(max_tokens=2, ignore_eos=True))
    assert not ({2, 7} & req.sampling_params.all_stop_token_ids)


def test_default_sampling_kwargs(make_model_config):
    cfg = make_model_config(generation_config={"temperature": 0.2, "top_p": 0.9, "top_k": 50,
                                               "repetition_penalty": 1.1, "max_new_tokens": 99, "do_sample": True})
    assert get_default_sampling_kwargs(cfg) == {"temperature": 0.2, "top_p": 0.9, "top_k": 50,
                                                "repetition_penalty": 1.1, "max_tokens": 99}
    assert get_default_sampling_kwargs(make_model_config(generation_config={})) == {}


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ([1, 49152], "out of vocabulary"),
    ([-1], "out of vocabulary"),
    ([1] * 64, "leaves no room"),
    ({"text": "x"}, "'prompt'"),
    (3.5, "Cannot use a prompt"),
    (["a", "b"], "list of integers"),
])
def test_bad_prompts(proc, prompt, match):
    with pytest.raises(ValueError, match=match):
        proc.process("r", prompt, SamplingParams(max_tokens=1))


def test_context_length_message(proc):
    with pytest.raises(ValueError) as e:
        proc.process("r", [1] * 60, SamplingParams(max_tokens=10))
    assert str(e.value).startswith("This model's maximum context length is 64 tokens. However, you requested "
                                   "70 tokens (60 in the messages, 10 in the completion).")
    assert e.value.param == "max_tokens"  # the HTTP error body's `param`
    assert proc.process("r", [1] * 60, SamplingParams(max_tokens=4)).sampling_params.max_tokens == 4


def test_too_many_logprobs(proc):
    with pytest.raises(ValueError, match="max-logprobs"):
        proc.process("r", [1], SamplingParams(max_tokens=1, logprobs=21))


def test_skip_tokenizer_init(make_model_config):
    proc = InputProcessor(make_model_config(skip_tokenizer_init=True), None)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        proc.process("r", "text", SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="Stop strings"):
        proc.process("r", [1, 2], SamplingParams(max_tokens=1, stop=["x"]))
    req = proc.process("r", [1, 2], SamplingParams(max_tokens=1))
    assert req.sampling_params.eos_token_id == 2  # from hf_config without a tokenizer
