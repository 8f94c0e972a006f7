"""OpenAI request models -> SamplingParams: field mapping, defaults, and refusals."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.sampling_params import RequestOutputKind


def test_completion_maps_openai_and_vllm_fields():
    req = CompletionRequest(prompt="hi", max_tokens=7, temperature=0.3, top_p=0.9, n=2, stop="END", seed=11,
                            presence_penalty=0.5, frequency_penalty=-0.5, top_k=5, min_p=0.1,
                            repetition_penalty=1.2, min_tokens=2, stop_token_ids=[3], ignore_eos=True,
                            include_stop_str_in_output=True, skip_special_tokens=False, logprobs=3,
                            logit_bias={"42": 2.5})
    sp = req.to_sampling_params()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.n, sp.stop, sp.seed) == (7, 0.3, 0.9, 2, ["END"], 11)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.top_k, sp.min_p) == (0.5, -0.5, 5, 0.1)
    assert (sp.repetition_penalty, sp.min_tokens, sp.stop_token_ids, sp.ignore_eos) == (1.2, 2, [3], True)
    assert sp.include_stop_str_in_output and not sp.skip_special_tokens
    assert sp.logprobs == 3 and sp.logit_bias == {42: 2.5}
    assert sp.output_kind == RequestOutputKind.FINAL_ONLY


def test_default_max_tokens_per_endpoint_and_generation_config_defaults():
    # The rule (docs/server.md): omitted or null max_tokens is the rest of the context on both endpoints.
    assert CompletionRequest(prompt="x").to_sampling_params().max_tokens is None
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params().max_tokens is None
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.to_sampling_params().max_tokens is None  # rest of the context
    gen = {"temperature": 0.6, "top_p": 0.95, "max_tokens": 99}
    sp = CompletionRequest(prompt="x", temperature=0.0).to_sampling_params(gen)
    # Explicit fields win; omitted ones take the generation config's values.
    assert (sp.temperature, sp.top_p, sp.max_tokens) == (0.0, 0.95, 99)


def test_chat_max_completion_tokens_wins_and_stream_kind():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                max_completion_tokens=9, stream=True, logprobs=True, top_logprobs=2)
    sp = req.to_sampling_params()
    assert sp.max_tokens == 9 and sp.logprobs == 2
    assert sp.output_kind == RequestOutputKind.DELTA  # streams ask for only what is new


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n must"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
])
def test_out_of_range_values_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CompletionRequest(prompt="x", **kwargs).to_sampling_params()


def test_seed_is_folded_into_63_bits_so_children_stay_valid():
    sp = CompletionRequest(prompt="x", seed=-1, n=3).to_sampling_params()
    assert 0 <= sp.seed < 2**63 and sp.seed + 2 < 2**64
    assert CompletionRequest(prompt="x", seed=5).to_sampling_params().seed == 5
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", seed=2**64)


def test_prompt_forms():
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    for empty in ("", [], [""]):
        with pytest.raises(ValueError, match="empty"):
            CompletionRequest(prompt=empty).prompts()


def test_chat_content_parts_are_joined_and_non_text_refused():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}])
    assert req.message_dicts() == [{"role": "user", "content": "a\nb"}]
    img = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="only text"):
        img.message_dicts()
    with pytest.raises(ValueError, match="at least one message") as info:
        ChatCompletionRequest(messages=[]).message_dicts()
    assert info.value.param == "messages"  # the 400 body's `param` (fresh-user trial: it was null)


def test_top_logprobs_without_logprobs_is_refused():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(ValueError, match="top_logprobs"):
        req.to_sampling_params()


@pytest.mark.parametrize("cls, base", [(CompletionRequest, {"prompt": "hi"}),
                                       (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})])
def test_stream_options_without_stream_are_refused(cls, base):
    with pytest.raises(ValidationError, match="stream_options can only be set when stream is true") as exc:
        cls(**base, stream_options={"include_usage": True})
    assert exc.value.errors()[0]["loc"] == ("stream_options",)
    assert cls(**base, stream=True, stream_options={"include_usage": True}).stream_options.include_usage
