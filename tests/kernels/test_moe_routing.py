"""One-launch top-k softmax routing (kernels/triton/moe_routing.py) vs the PyTorch statement of
`select_experts`. CPU: the Triton interpreter, tiny shapes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.triton.moe_routing import topk_softmax


def _torch_routing(logits, top_k, renormalize):
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize,dtype", [
    (1, 128, 8, True, torch.float32),  # Qwen3-30B-A3B decode
    (37, 32, 4, True, torch.float16),  # gpt-oss-20b (router in the model dtype), several programs
    (5, 3, 1, False, torch.float32),  # fewer experts than the padded row
    (9, 160, 6, False, torch.float32),
])
def test_topk_softmax_matches_torch(num_tokens, num_experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(num_experts)
    logits = (torch.randn(num_tokens, num_experts, generator=g) * 3).to(dtype)
    weights, ids = topk_softmax(logits, top_k, renormalize)
    ref_w, ref_ids = _torch_routing(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-7)


def test_topk_softmax_ties_take_the_lowest_expert_and_strided_rows():
    logits = torch.zeros(2, 8)[:, :6]  # a strided view; every probability ties
    logits[1, 4] = 1.0
    weights, ids = topk_softmax(logits, 3, renormalize=True)
    assert ids.tolist() == [[0, 1, 2], [4, 0, 1]]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(logits, 7, renormalize=True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN row, by design
def test_topk_softmax_never_repeats_an_expert_when_logits_run_out():
    # Masked-out experts (-inf logits): after the one finite logit only -inf ones are left; each must still
    # be chosen once (weight 0), not the finite expert again.
    inf = float("-inf")
    logits = torch.tensor([[0.0, inf, inf, inf, inf], [inf, 2.0, inf, 1.0, inf]])
    weights, ids = topk_softmax(logits, 3, renormalize=False)
    for row in ids.tolist():
        assert len(set(row)) == 3 and all(0 <= i < 5 for i in row)
    assert ids[0, 0] == 0 and ids[1, :2].tolist() == [1, 3]
    assert weights[0].tolist() == [1.0, 0.0, 0.0] and weights[1, 2] == 0.0
    _, ids = topk_softmax(torch.full((1, 5), float("nan")), 2, renormalize=False)
    assert ((ids >= 0) & (ids < 5)).all()  # garbage logits still give ids the experts' tables can index


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,num_experts,top_k,dtype", [
    (4096, 128, 8, torch.float32), (3, 128, 8, torch.bfloat16), (1000, 32, 4, torch.bfloat16),
])
def test_topk_softmax_gpu_real_sizes(num_tokens, num_experts, top_k, dtype):
    """float32 logits: the same ids; bfloat16 logits tie often (torch.topk orders ties as it likes), so there the
    picked experts' probabilities are compared: descending, within a few ulps of PyTorch's softmax, none left out."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=g, device="cuda").to(dtype)
    weights, ids = topk_softmax(logits, top_k, renormalize=False)
    ref_w, ref_ids = _torch_routing(logits, top_k, False)
    if dtype == torch.float32:
        assert torch.equal(ids, ref_ids)
    probs = torch.softmax(logits.float(), dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, ids), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=1e-8)
    assert torch.all(weights[:, :-1] >= weights[:, 1:])
