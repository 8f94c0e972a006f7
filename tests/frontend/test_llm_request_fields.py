"""Request fields observed end to end on the offline `LLM` with the bundled SmolLM2 (float32, CPU).

bad_words removes a word greedy decoding produces; prompt_logprobs equal
transformers' log-softmax over the prompt (hf_smollm2, built from the same
GGUF) within 1e-4, with the prompt in one step or split over several
(chunked prefill), and also when the prompt is in the prefix cache;
truncate_prompt_tokens keeps the last N tokens; min_tokens masks EOS under
ignore_eos; bad input raises ValueError with a sentence.
"""

from __future__ import annotations

import pytest

import torch

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow  # the real SmolLM2 in two engines (one shared with test_llm_parity.py)

PROMPT = "The capital of France is"
LONG_PROMPT = ("Gravity is the force by which a planet or other body draws objects toward its center. "
               "The force of gravity keeps all of the planets in orbit around the sun.")
K = 5


def _llm(gguf: str, **kwargs) -> LLM:
    return LLM(gguf, dtype="float32", max_model_len=256, num_gpu_blocks_override=64, seed=0, **kwargs)


@pytest.fixture(scope="module")
def llm(smollm2_llm) -> LLM:
    return smollm2_llm  # tests/conftest.py's, shared with test_llm_parity.py


@pytest.fixture(scope="module")
def chunked_llm(smollm2_gguf) -> LLM:
    """Steps of at most 8 tokens: LONG_PROMPT (~35 tokens) is prefilled over 5 steps."""
    return _llm(smollm2_gguf, enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)


def _greedy(llm: LLM, prompt, **kwargs):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, **kwargs), use_tqdm=False)[0]


def test_bad_words_remove_a_word_greedy_decoding_produces(llm):
    plain = _greedy(llm, PROMPT).outputs[0].text
    assert plain.startswith(" Paris.")
    banned = _greedy(llm, PROMPT, bad_words=["Paris"]).outputs[0].text
    assert "Paris" not in banned and banned != plain
    # A two-token word: only its last token is masked, and only right after its first.
    tail = _greedy(llm, PROMPT, bad_words=["Paris."]).outputs[0].text
    assert tail.startswith(" Paris") and not tail.startswith(" Paris.")


def test_bad_word_that_tokenizes_to_nothing_raises(llm):
    with pytest.raises(ValueError, match="tokenizes to no tokens"):
        _greedy(llm, PROMPT, bad_words=["Paris", "  "])


def _reference(hf_smollm2, prompt_ids: list[int]):
    model, _ = hf_smollm2
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)  # row p predicts token p + 1


def _check_against_reference(out, ref) -> None:
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(ids) and lps[0] is None
    for p in range(1, len(ids)):
        pos = lps[p]
        actual = pos[ids[p]]
        assert actual.logprob == pytest.approx(float(ref[p - 1, ids[p]]), abs=1e-4)
        # Rank: 1 + tokens more likely; deep in the tail, values within 1e-4 of it may order either way.
        row, val = ref[p - 1], float(ref[p - 1, ids[p]])
        assert int((row > val + 1e-4).sum()) + 1 <= actual.rank <= int((row > val - 1e-4).sum()) + 1
        top = torch.topk(ref[p - 1], K)
        for tid, val in zip(top.indices.tolist(), top.values.tolist()):
            if abs(val - float(top.values[-1])) > 1e-4:  # skip a tie at the cut-off
                assert tid in pos and pos[tid].logprob == pytest.approx(val, abs=1e-4)
        assert len(pos) in (K, K + 1)
        assert isinstance(actual.decoded_token, str)


@pytest.mark.parametrize("which", ["llm", "chunked_llm"])
def test_prompt_logprobs_match_transformers(request, hf_smollm2, which):
    engine: LLM = request.getfixturevalue(which)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=K)
    out = engine.generate(LONG_PROMPT, params, use_tqdm=False)[0]
    assert len(out.prompt_token_ids) > 16  # several 8-token chunks in the chunked engine
    _check_against_reference(out, _reference(hf_smollm2, out.prompt_token_ids))
    # Again: the prompt's blocks are now in the prefix cache, yet every position is computed.
    again = engine.generate(LONG_PROMPT, params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert [None if p is None else {t: lp.logprob for t, lp in p.items()} for p in again.prompt_logprobs] == \
        [None if p is None else {t: lp.logprob for t, lp in p.items()} for p in out.prompt_logprobs]


def test_prompt_logprobs_off_by_default_and_bounded(llm):
    assert _greedy(llm, PROMPT).prompt_logprobs is None
    with pytest.raises(ValueError, match="prompt_logprobs.*--max-logprobs"):
        _greedy(llm, PROMPT, prompt_logprobs=21)


def test_truncate_prompt_tokens_keeps_the_last_n(llm):
    full_ids = llm.get_tokenizer().encode(LONG_PROMPT)
    out = _greedy(llm, LONG_PROMPT, truncate_prompt_tokens=6)
    assert out.prompt_token_ids == full_ids[-6:]
    assert out.outputs[0].token_ids == _greedy(llm, full_ids[-6:]).outputs[0].token_ids
    assert _greedy(llm, LONG_PROMPT, truncate_prompt_tokens=-1).prompt_token_ids == full_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens .*257.* larger than"):
        _greedy(llm, LONG_PROMPT, truncate_prompt_tokens=257)


def test_min_tokens_masks_eos_even_under_ignore_eos(llm):
    eos = llm.get_tokenizer().eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    ids = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert eos not in ids[:3] and ids[3:] == [eos, eos]


def test_allowed_token_ids_and_logit_bias_take_effect(llm):
    tok = llm.get_tokenizer()
    allowed = tok.encode(" cheese bread", add_special_tokens=False)
    ids = _greedy(llm, PROMPT, allowed_token_ids=allowed).outputs[0].token_ids
    assert set(ids) <= set(allowed)
    forced = tok.encode(" cheese", add_special_tokens=False)[0]
    assert _greedy(llm, PROMPT, logit_bias={forced: 100.0}).outputs[0].token_ids[:3] == [forced] * 3


def test_chat_continue_final_message_and_template_variables(llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    msgs = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite is"}]
    cont = llm.chat(msgs, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("My favourite is")  # the reply is continued, its turn left open
    closed = llm.chat(msgs, params, use_tqdm=False, add_generation_prompt=False)[0]
    assert not closed.prompt.endswith("My favourite is")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(msgs, params, use_tqdm=False, continue_final_message=True)
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[0].content }}{{ tail }}"
    out = llm.chat(msgs[:1], params, use_tqdm=False, chat_template=template, chat_template_kwargs={
        "documents": [{"title": "a", "text": "red"}], "tail": "!"})[0]
    assert out.prompt == "[a: red]Name a color.!"
