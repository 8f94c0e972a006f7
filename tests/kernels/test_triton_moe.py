"""Triton fused MoE (grouped GEMM) vs the PyTorch reference; routing vs a direct formula.

CPU: the Triton interpreter (conftest.py), float32, tiny shapes. CUDA: the
same contract at bf16/fp16 sizes (skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.triton.fused_moe import (
    _TABLE,
    GroupedGemmConfig,
    default_gemm_configs,
    fused_experts_triton,
    moe_align_block_size,
    moe_sum,
)
from tokenmill.kernels.triton.moe_align import moe_align_block_size_torch
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts

CUDA = torch.cuda.is_available()


def _problem(num_tokens, hidden, inter, num_experts, top_k, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(device, dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(device, dtype)
    logits = torch.randn(num_tokens, num_experts, generator=g).to(device)
    return x, w13, w2, logits


def test_moe_align_block_size_groups_and_pads_by_expert():
    topk_ids = torch.tensor([[2, 0], [0, 1], [2, 2], [0, 2]])
    sorted_ids, tile_experts, num_post = moe_align_block_size(topk_ids, block_m=2, num_experts=4)
    pad = topk_ids.numel()
    # expert 0: pairs 1, 2, 6 -> 2 tiles; expert 1: pair 3 -> 1 tile; expert 2: pairs 0, 4, 5, 7 -> 2 tiles
    assert num_post.tolist() == [10]
    assert sorted_ids[:10].tolist() == [1, 2, 6, pad, 3, pad, 0, 4, 5, 7]
    assert tile_experts[:5].tolist() == [0, 0, 1, 2, 2]
    assert torch.all(sorted_ids[10:] == pad)


def _assert_same_alignment(topk_ids, block_m, num_experts, chunk):
    got = moe_align_block_size(topk_ids, block_m, num_experts, chunk=chunk)
    want = moe_align_block_size_torch(topk_ids, block_m, num_experts)
    for name, g, w in zip(("sorted_pair_ids", "tile_expert_ids", "num_post"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name} differs for T={topk_ids.shape[0]} k={topk_ids.shape[1]} E={num_experts} " \
                                  f"block_m={block_m} chunk={chunk}"


def test_triton_align_equals_torch_on_random_shapes():
    """The Triton sort (one launch up to `chunk` pairs, two above) gives the PyTorch sort's tensors bit for bit:
    pair order inside an expert, padding marker, tile experts (the last expert past the padded total)."""
    g = torch.Generator().manual_seed(0)
    cases = 0
    for _ in range(24):
        num_experts = int(torch.randint(1, 70, (1,), generator=g))
        top_k = int(torch.randint(1, min(num_experts, 8) + 1, (1,), generator=g))
        num_tokens = int(torch.randint(1, 48, (1,), generator=g))
        block_m = [2, 16, 32, 64][int(torch.randint(0, 4, (1,), generator=g))]
        chunk = [32, 64, 256][int(torch.randint(0, 3, (1,), generator=g))]
        ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
        _assert_same_alignment(ids, block_m, num_experts, chunk)
        cases += 1
    # Skewed routing (one expert takes everything, over several chunks), int32 ids, a transposed view, no tokens.
    _assert_same_alignment(torch.full((40, 4), 6), 16, 7, 32)
    _assert_same_alignment(torch.randint(0, 128, (20, 8), generator=g, dtype=torch.int32), 16, 128, 64)
    _assert_same_alignment(torch.randint(0, 5, (3, 11), generator=g).t(), 16, 5, 32)
    _assert_same_alignment(torch.zeros(0, 8, dtype=torch.int64), 16, 128, 256)
    assert cases == 24


def test_select_experts_renormalize():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w[0], p[[1, 2]])
    w, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(w[0], p[[1, 2]] / p[[1, 2]].sum())


def test_reference_matches_dense_loop():
    x, w13, w2, logits = _problem(7, 16, 8, 4, 2)
    w, ids = select_experts(logits, 2, True)
    out = fused_experts_reference(x, w13, w2, w, ids)
    expected = torch.zeros_like(x)
    for t in range(7):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            expected[t] += w[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "num_tokens,hidden,inter,num_experts,top_k,block_m",
    [
        (1, 32, 16, 4, 2, 16),  # one decode token: most experts empty
        (13, 48, 24, 4, 2, 16),  # K and N not multiples of the tiles
        (40, 32, 32, 8, 3, 16),  # several tiles per expert
        (9, 32, 16, 3, 1, 32),  # top-1
    ],
)
def test_triton_matches_reference(num_tokens, hidden, inter, num_experts, top_k, block_m):
    x, w13, w2, logits = _problem(num_tokens, hidden, inter, num_experts, top_k, device="cuda" if CUDA else "cpu")
    w, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    ref = fused_experts_reference(x, w13, w2, w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids, block_m=block_m)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300, 2048])
def test_triton_gpu_half_precision(dtype, num_tokens):
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("bf16 unsupported on this GPU")
    x, w13, w2, logits = _problem(num_tokens, 256, 512, 8, 2, dtype=dtype, device="cuda")
    w, ids = select_experts(logits, 2, renormalize=True)
    ref = fused_experts_reference(x.float(), w13.float(), w2.float(), w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids)
    assert out.dtype == dtype
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 5e-3)


def _full_experts(num_experts=3, hidden=16, inter=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, inter, hidden, generator=g)
    w3 = torch.randn(num_experts, inter, hidden, generator=g)
    w2 = torch.randn(num_experts, hidden, inter, generator=g)
    return w1, w3, w2


def _moe_on_rank(monkeypatch, rank, tp, num_experts=3, hidden=16, inter=8):
    import tokenmill.layers.fused_moe.layer as moe_layer

    monkeypatch.setattr(moe_layer, "get_tensor_model_parallel_rank", lambda: rank)
    monkeypatch.setattr(moe_layer, "get_tensor_model_parallel_world_size", lambda: tp)
    return moe_layer.FusedMoE(num_experts, 2, hidden, inter, renormalize=False, reduce_results=False)


def test_expert_weights_shard_over_tp_and_partial_sums_add_up(monkeypatch):
    from tokenmill.layers.fused_moe import load_expert_weight

    w1, w3, w2 = _full_experts()
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    logits = torch.randn(5, 3, generator=torch.Generator().manual_seed(3))
    full = _moe_on_rank(monkeypatch, 0, 1)
    params = {f"moe.experts.{n}": p for n, p in full.named_parameters()}
    for e in range(3):  # Mixtral names
        for name, w in (("w1", w1[e]), ("w3", w3[e]), ("w2", w2[e])):
            assert load_expert_weight(params, f"moe.experts.{e}.{name}.weight", w) is not None
    ref = full(x, logits)
    partial = torch.zeros_like(ref)
    for rank in range(2):
        moe = _moe_on_rank(monkeypatch, rank, 2)
        params = {f"mlp.experts.{n}": p for n, p in moe.named_parameters()}
        # GGUF-style stacked tensors [E, I, H] / [E, H, I]
        load_expert_weight(params, "mlp.experts.gate_proj.weight", w1)
        load_expert_weight(params, "mlp.experts.up_proj.weight", w3)
        load_expert_weight(params, "mlp.experts.down_proj.weight", w2)
        torch.testing.assert_close(moe.w13_weight[:, :4], w1[:, rank * 4:(rank + 1) * 4])
        torch.testing.assert_close(moe.w13_weight[:, 4:], w3[:, rank * 4:(rank + 1) * 4])
        torch.testing.assert_close(moe.w2_weight, w2[:, :, rank * 4:(rank + 1) * 4])
        # HF 5 stacked gate_up [E, 2I, H] loads the same slices
        other = _moe_on_rank(monkeypatch, rank, 2)
        other_params = {f"e.experts.{n}": p for n, p in other.named_parameters()}
        load_expert_weight(other_params, "e.experts.gate_up_proj", torch.cat([w1, w3], dim=1))
        torch.testing.assert_close(other.w13_weight, moe.w13_weight)
        partial += moe(x, logits)
    # Column/row split of each expert's MLP: the per-rank outputs are partial sums of the full one.
    torch.testing.assert_close(partial, ref, rtol=1e-5, atol=1e-5)
    assert load_expert_weight(params, "mlp.gate.weight", torch.zeros(3, 16)) is None


def test_swigluoai_biased_experts_triton_matches_reference_and_hf_formula():
    """gpt-oss experts: biases on both projections, clamped SwiGLU; Triton (biases around the unchanged
    grouped GEMM) vs the reference vs a per-token loop of transformers' formula."""
    device = "cuda" if CUDA else "cpu"  # Triton takes CUDA tensors on a GPU machine, CPU ones under the interpreter
    x, w13, w2, logits = _problem(9, 32, 16, 4, 2, device=device, seed=3)
    x = x * 4  # push gate/up past the +-7 clamp for some rows
    g = torch.Generator().manual_seed(4)
    b13, b2 = torch.randn(4, 32, generator=g).to(device), torch.randn(4, 32, generator=g).to(device)
    w, ids = select_experts(logits, 2, True)
    ref = fused_experts_reference(x, w13, w2, w, ids, "swigluoai", b13, b2)
    expected = torch.zeros_like(x)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t] + b13[e]).chunk(2)
            gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
            expected[t] += w[t, j] * (w2[e] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + b2[e])
    torch.testing.assert_close(ref, expected, rtol=1e-5, atol=1e-5)
    assert (x @ w13[0, :16].T + b13[0, :16]).abs().max() > 7, "the clamp must be exercised"
    out = fused_experts_triton(x, w13, w2, w, ids, "swigluoai", w13_bias=b13, w2_bias=b2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_moe_sum_adds_top_k_rows_in_float32():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0], [9.0, 10.0], [11.0, 12.0]])
    torch.testing.assert_close(moe_sum(x, 3, torch.float32), torch.tensor([[9.0, 12.0], [27.0, 30.0]]))
    big = torch.full((2, 3), 60000.0)  # float16 sums past 65504 clamp instead of becoming inf
    assert moe_sum(big, 2, torch.float16).tolist() == [[65504.0] * 3]


def test_default_gemm_configs_table_overrides_and_shared_block_m():
    cuda = torch.device("cpu")  # device_facts reports an H200 (9.0) off CUDA
    d13, d2 = default_gemm_configs(8, 128, torch.bfloat16, cuda)  # Qwen3-30B-A3B, one decode token
    assert d13.block_m == d2.block_m == 16 and min(d13.block_n, d13.block_k, d13.num_warps, d13.num_stages) > 0
    big13, _ = default_gemm_configs(4096 * 8, 128, torch.bfloat16, cuda)
    assert big13.block_m > d13.block_m
    # float32: the fixed settings (exact dots take twice the shared memory)
    f13, _ = default_gemm_configs(8, 128, torch.float32, cuda)
    assert (f13.block_m, f13.block_n, f13.block_k) == (16, 64, 32)
    o13, o2 = default_gemm_configs(8, 128, torch.bfloat16, cuda, GroupedGemmConfig(block_n=32, num_warps=2),
                                   GroupedGemmConfig(block_m=16, block_k=64))
    assert (o13.block_n, o13.num_warps, o13.block_k) == (32, 2, d13.block_k)
    assert (o2.block_k, o2.block_n, o2.block_m, o13.block_m) == (64, d2.block_n, 16, 16)
    assert default_gemm_configs(8, 128, torch.bfloat16, cuda, block_m=64)[1].block_m == 64
    with pytest.raises(ValueError, match="block_m"):
        default_gemm_configs(8, 128, torch.bfloat16, cuda, GroupedGemmConfig(block_m=16), GroupedGemmConfig(block_m=32))


@pytest.mark.parametrize("w13_config,w2_config", [
    (GroupedGemmConfig(block_m=16, block_n=16, block_k=16, group_m=2), GroupedGemmConfig(block_n=32, group_m=3)),
    (GroupedGemmConfig(block_m=32, block_n=32, block_k=64, num_warps=2), None),
])
def test_triton_configs_match_reference(w13_config, w2_config):
    """Other tile shapes and the GROUP_M-swizzled grid (a group size that does not divide the tile count)."""
    x, w13, w2, logits = _problem(21, 48, 24, 5, 3, device="cuda" if CUDA else "cpu", seed=5)
    w, ids = select_experts(logits, 3, renormalize=True)
    ref = fused_experts_reference(x, w13, w2, w, ids)
    out = fused_experts_triton(x, w13, w2, w, ids, w13_config=w13_config, w2_config=w2_config)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts,block_m", [
    (1, 8, 128, 16), (32, 8, 128, 16), (33, 8, 128, 16), (4096, 8, 128, 64), (4096, 4, 32, 128), (1000, 8, 256, 32),
])
def test_triton_align_equals_torch_gpu_and_replays_in_a_cuda_graph(num_tokens, top_k, num_experts, block_m):
    """Real sizes (one launch at 256 pairs, two above), then captured once in a CUDA graph and replayed on
    other routings (no host sync, static shapes)."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    ids = torch.randint(0, num_experts, (num_tokens, top_k), generator=g, device="cuda")
    got = moe_align_block_size(ids, block_m, num_experts)
    for a, b in zip(got, moe_align_block_size_torch(ids, block_m, num_experts)):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_align_block_size(ids, block_m, num_experts)
    for skew in (False, True):
        new = torch.randint(0, num_experts, ids.shape, generator=g, device="cuda")
        ids.copy_(new % 3 if skew else new)  # skewed: three experts take every pair
        graph.replay()
        for a, b in zip(captured, moe_align_block_size_torch(ids, block_m, num_experts)):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("row", range(len(_TABLE)))
def test_triton_gpu_every_table_row(row):
    """Each default `_TABLE` row's tiles (forced, at a token count of another row too) against float32."""
    _, c13, c2 = _TABLE[row]
    for num_tokens in (3, 700):
        x, w13, w2, logits = _problem(num_tokens, 512, 384, 16, 4, dtype=torch.bfloat16, device="cuda", seed=row)
        w, ids = select_experts(logits, 4, renormalize=True)
        b13 = torch.randn(16, 768, device="cuda").bfloat16()
        b2 = torch.randn(16, 512, device="cuda").bfloat16()
        ref = fused_experts_reference(x.float(), w13.float(), w2.float(), w, ids, "swigluoai", b13.float(), b2.float())
        out = fused_experts_triton(x, w13, w2, w, ids, "swigluoai", w13_bias=b13, w2_bias=b2, w13_config=c13,
                                   w2_config=c2)
        assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2
