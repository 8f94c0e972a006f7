"""PromptLogprobsCollector: prompt positions scored chunk by chunk give the rows of one whole-prompt pass.

The "model" is a fixed random LM head over fixed random hidden states, so the
expected logprobs are a log_softmax computed here directly.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tokenmill.worker.prompt_logprobs import PromptLogprobsCollector

V, H = 50, 8


def _setup(num_prompt: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_prompt, H, generator=g)  # hidden state of every prompt position
    head = torch.randn(H, V, generator=g)
    prompt = np.random.default_rng(seed).integers(0, V, num_prompt)
    return hidden, head, prompt


def _run_chunks(hidden, head, prompt, chunks: list[int], k: int):
    """Feed the prompt as consecutive chunks (one request per step); returns the completed lists."""
    col = PromptLogprobsCollector(V)
    col.add_request("r", k, num_output_tokens=0)
    start, done = 0, {}
    for n in chunks:
        step_hidden = hidden[start : start + n]
        done.update(col.collect(lambda h: h @ head, step_hidden, ["r"], np.array([0, n]), np.array([start]),
                                [prompt]))
        if start + n < len(prompt):
            assert not done  # nothing is returned before the prompt ends
        start += n
    return done["r"], col


def test_rows_match_log_softmax_and_chunking_changes_nothing():
    hidden, head, prompt = _setup(11)
    whole, col = _run_chunks(hidden, head, prompt, [11], k=3)
    assert not col.active  # finished requests are forgotten
    ref = torch.log_softmax(hidden @ head, dim=-1)  # row p predicts token p + 1
    assert len(whole.logprob_token_ids) == 10
    for p in range(10):
        actual = int(prompt[p + 1])
        ids = whole.logprob_token_ids[p]
        assert ids[0] == actual
        assert whole.logprobs[p][0] == pytest.approx(float(ref[p, actual]), abs=1e-6)
        top = torch.topk(ref[p], 3)
        assert ids[1:] == top.indices.tolist()
        assert whole.sampled_token_ranks[p] == int((ref[p] > ref[p, actual]).sum()) + 1
    for chunks in ([4, 4, 3], [1] * 11, [10, 1], [5, 6]):
        split, _ = _run_chunks(hidden, head, prompt, chunks, k=3)
        assert split.logprob_token_ids == whole.logprob_token_ids
        np.testing.assert_allclose(split.logprobs, whole.logprobs, rtol=0, atol=1e-6)
        assert split.sampled_token_ranks == whole.sampled_token_ranks


def test_k_zero_single_token_and_untracked_requests():
    hidden, head, prompt = _setup(4)
    rows, _ = _run_chunks(hidden, head, prompt, [4], k=0)
    assert [len(r) for r in rows.logprob_token_ids] == [1, 1, 1]
    one, _ = _run_chunks(hidden[:1], head, prompt[:1], [1], k=2)
    assert one.logprob_token_ids == []  # a one-token prompt has only the leading None
    col = PromptLogprobsCollector(V)
    col.add_request("resumed", 2, num_output_tokens=3)  # its prompt logprobs went out before the preemption
    col.add_request("plain", None, num_output_tokens=0)
    assert not col.active
