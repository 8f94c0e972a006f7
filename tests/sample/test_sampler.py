"""Sampler + SamplingState on small hand-made batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.sample.sampler import Sampler
from tokenmill.sample.state import SamplingState
from tokenmill.sampling_params import SamplingParams

V = 50


def _sample(params: list[SamplingParams], logits: torch.Tensor, outputs: list[list[int]] | None = None,
            prompts: list[list[int]] | None = None):
    n = len(params)
    prompts = prompts or [[1, 2, 3]] * n
    outputs = outputs or [[] for _ in range(n)]
    state = SamplingState(n, V, torch.device("cpu"))
    tokens = np.zeros((n, 32), np.int32)
    num_prompt = np.array([len(p) for p in prompts])
    num_tokens = np.array([len(p) + len(o) for p, o in zip(prompts, outputs)])
    for i, (p, pr, o) in enumerate(zip(params, prompts, outputs)):
        tokens[i, : len(pr) + len(o)] = pr + o
        state.add(i, p, len(o))
    md = state.make_metadata(np.arange(n), tokens, num_prompt, num_tokens)
    return Sampler()(logits, md), md


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_skips_extra_passes():
    logits = _logits(4)
    out, md = _sample([SamplingParams(temperature=0.0)] * 4, logits)
    assert md.all_greedy and md.temperature is None and md.repetition_penalty is None
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


def test_top_k_one_equals_greedy():
    logits = _logits(6, seed=1)
    out, md = _sample([SamplingParams(temperature=1.3, top_k=1)] * 6, logits)
    assert md.all_random
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_top_p_tiny_keeps_only_the_top_token():
    logits = _logits(5, seed=2)
    out, _ = _sample([SamplingParams(temperature=1.0, top_p=1e-6)] * 5, logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_min_p_one_keeps_only_the_top_token():
    logits = _logits(5, seed=3)
    out, _ = _sample([SamplingParams(temperature=1.0, min_p=1.0)] * 5, logits)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = _logits(4, seed=4)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1)] * 2
    out, md = _sample(params, logits)
    assert md.greedy_mask is not None and md.greedy_mask.tolist() == [True, False, True, False]
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(1, seed=5).expand(5, V).contiguous()
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [_sample([seeded], logits[:1])[0].sampled_token_ids[0].item() for _ in range(3)]
    assert len(set(alone)) == 1
    mixed = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0.7, seed=9), SamplingParams(temperature=0.0)]
    got = _sample(mixed, logits[:4])[0].sampled_token_ids[1].item()
    assert got == alone[0]
    # Another seed gives a different stream: over a flat distribution, 5 draws differ somewhere.
    flat = torch.zeros(1, V)
    a = [_sample([SamplingParams(temperature=1.0, seed=s)], flat)[0].sampled_token_ids.item() for s in (1, 2, 3, 4, 5)]
    assert len(set(a)) > 1


def test_resumed_seeded_request_continues_its_stream():
    """A seeded request resumed after k outputs draws what a never-preempted one would draw next."""
    flat = torch.zeros(1, V)
    p = SamplingParams(temperature=1.0, seed=77)
    state = SamplingState(1, V, torch.device("cpu"))
    state.add(0, p, 0)
    tokens, npr = np.zeros((1, 8), np.int32), np.array([1])
    seq = [Sampler()(flat, state.make_metadata(np.arange(1), tokens, npr, npr + k)).sampled_token_ids.item() for k in range(4)]
    resumed = _sample([p], flat, outputs=[seq[:3]], prompts=[[0]])[0].sampled_token_ids.item()
    assert resumed == seq[3]


def test_penalties_change_logits_as_defined():
    logits = torch.zeros(1, V)
    logits[0, :6] = torch.tensor([2.0, -2.0, 1.0, 1.0, 0.5, 0.4])
    # prompt has token 0 and 1; output has token 2 twice and token 3 once.
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.3, presence_penalty=0.5)
    _, md = _sample([p], logits, outputs=[[2, 2, 3]], prompts=[[0, 1]])
    processed = Sampler._process_logits(logits.clone(), md)[0, :6]
    expected = torch.tensor([2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.3 * 2 - 0.5, 1.0 / 2 - 0.3 - 0.5, 0.5, 0.4])
    torch.testing.assert_close(processed, expected)


def test_penalty_changes_greedy_choice():
    logits = torch.zeros(1, V)
    logits[0, 7], logits[0, 8] = 5.0, 4.0
    out, _ = _sample([SamplingParams(temperature=0.0, frequency_penalty=2.0)], logits, outputs=[[7]])
    assert out.sampled_token_ids.item() == 8


def test_min_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 9] = 10.0  # the stop token is by far the best
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[9])
    out, _ = _sample([p, p], logits, outputs=[[4], [4, 5]])
    assert out.sampled_token_ids.tolist()[0] != 9  # 1 output < min_tokens: masked
    assert out.sampled_token_ids.tolist()[1] == 9  # 2 outputs: allowed


def test_logit_bias_and_allowed_token_ids():
    logits = torch.zeros(2, V)
    logits[:, 3] = 5.0
    out, _ = _sample([SamplingParams(temperature=0.0, logit_bias={11: 100.0}),
                      SamplingParams(temperature=0.0, allowed_token_ids=[20, 21])], logits)
    assert out.sampled_token_ids.tolist()[0] == 11
    assert out.sampled_token_ids.tolist()[1] in (20, 21)


def test_logprobs_shape_values_and_ranks():
    logits = _logits(3, seed=6)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, top_k=3, logprobs=0),
              SamplingParams(temperature=0.0)]
    out, md = _sample(params, logits)
    assert md.max_num_logprobs == 2
    assert out.logprob_token_ids.shape == (3, 3) and out.logprobs.shape == (3, 3)
    ref = logits.log_softmax(-1)
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.logprob_token_ids))
    order = ref.argsort(-1, descending=True)
    assert torch.equal(out.logprob_token_ids[:, 1:], order[:, :2])
    for i in range(3):
        assert out.sampled_token_ranks[i].item() == (order[i] == out.sampled_token_ids[i]).nonzero().item() + 1
    assert out.sampled_token_ranks[0].item() == 1  # greedy row samples the top token


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_sampling_follows_the_distribution(temperature):
    logits = torch.tensor([[0.0, 1.0, 2.0] + [-1e9] * (V - 3)]).expand(4000, V).contiguous()
    torch.manual_seed(0)
    out, _ = _sample([SamplingParams(temperature=temperature)] * 4000, logits)
    freq = torch.bincount(out.sampled_token_ids, minlength=V)[:3].float() / 4000
    expected = (logits[0, :3] / temperature).softmax(-1)
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_cols", [256, 257, 385, 1000, 49152])
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("num_rows", [8, 12])  # float32, contiguous: the NumPy path up to 8 rows, chunks above
def test_argmax_rows_matches_torch_argmax_with_ties_tails_and_nan(dtype, num_cols, sliced, num_rows):
    from tokenmill.sample.ops import argmax_rows

    g = torch.Generator().manual_seed(num_cols)
    # sliced: rows of a wider buffer (a padded vocabulary), not contiguous
    x = torch.randn(num_rows, num_cols + 24 * sliced, generator=g).to(dtype)[:, :num_cols]
    top = x.max() + 1
    x[1, num_cols - 1] = top  # the maximum in the last chunk's last column
    x[2, 0] = top  # ties: the first occurrence wins
    x[2, num_cols // 2] = top
    x[2, num_cols - 1] = top
    x[3, :] = 0.5  # a whole row tied
    x[4, num_cols // 3] = float("nan")  # NaN counts as the maximum
    x[5, num_cols // 2] = float("-inf")
    x[5, num_cols - 2] = x[5, num_cols // 4] = float("nan")  # two NaNs: the first one (rows 0-7: NumPy path)
    x[6, :] = float("-inf")  # every token banned
    x[7, 130] = top  # a tie between two chunks after the first
    x[7, 255] = top
    if num_rows > 8:
        x[8, 200] = x[8, 7] = float("nan")  # two NaNs: the first one
    got = argmax_rows(x)
    assert got.dtype == torch.int64
    assert torch.equal(got, x.argmax(dim=-1))
    assert got[2] == 0 and got[3] == 0 and got[5] == num_cols // 4 and got[6] == 0 and got[7] == 130
    assert got[1] == num_cols - 1
    if num_rows > 8:
        assert got[8] == 7


def test_argmax_rows_numpy_path_takes_one_row_of_inference_logits():
    """The served decode case: one float32 row made under inference mode (the sampler's input)."""
    from tokenmill.sample.ops import argmax_rows

    with torch.inference_mode():
        x = torch.randn(1, 49152, generator=torch.Generator().manual_seed(1))
        x[0, 40000] = 100.0
        got = argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (1,) and int(got[0]) == 40000


def test_argmax_rows_falls_back_for_short_rows_and_other_layouts():
    from tokenmill.sample.ops import argmax_rows

    x = torch.randn(4, 129)  # one chunk and a tail: plain argmax
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    t = torch.randn(300, 5).t()  # last stride 300
    assert torch.equal(argmax_rows(t), t.argmax(dim=-1))
    assert argmax_rows(torch.randn(0, 512)).shape == (0,)
