"""Quantized fused MoE (`kernels/triton/fused_moe_quant.py`) vs `fused_experts_reference` on dequantized experts.

CPU: the Triton interpreter, float32 / float16, tiny shapes (its bfloat16
tl.dot is wrong, see test_quant_linear.py). GPU: Qwen3-30B-A3B expert shapes.
"""

from __future__ import annotations

import pytest
import torch
from quant_helpers import column_shard, dense, random_quant, row_shard

from tokenmill.kernels.triton import quant_linear as ql
from tokenmill.kernels.triton.fused_moe_quant import GroupedQuantConfig, fused_experts_quant_triton
from tokenmill.layers.fused_moe.reference import fused_experts_reference, select_experts

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers start as NaN, so a row the kernels skip fails the comparison."""
    monkeypatch.setattr(ql, "_new_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def _experts(num_experts, hidden, inter, bits, group_size, zeros, act_order, dtype=torch.float32, seed=0):
    w13 = random_quant(2 * inter, hidden, bits, group_size, zeros, act_order, dtype, num_experts, seed, DEV)
    w2 = random_quant(hidden, inter, bits, group_size, zeros, act_order, dtype, num_experts, seed + 1, DEV)
    return w13, w2


def _routing(num_tokens, hidden, num_experts, top_k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(DEV, dtype)
    weights, ids = select_experts(torch.randn(num_tokens, num_experts, generator=g).to(DEV), top_k, top_k > 1)
    return x, weights, ids


def _check(out, x, w13, w2, weights, ids, activation="silu", tol=1e-4):
    ref = fused_experts_reference(x.float(), dense(w13, x.dtype).float(), dense(w2, x.dtype).float(), weights, ids,
                                  activation)
    assert out.shape == ref.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("num_tokens,hidden,inter,num_experts,top_k,block_m", [
    (1, 64, 32, 4, 2, 16),  # one decode token: most experts empty
    (13, 96, 40, 4, 2, 16),  # H and I not multiples of the tiles; I = 40 not a multiple of 32 (8-bit p = 4 ok)
    (40, 64, 64, 8, 3, 16),  # several tiles per expert
    (9, 64, 32, 3, 1, 32),  # top-1
])
@pytest.mark.parametrize("bits,group_size,zeros,act_order", [
    (4, 32, True, False), (4, -1, False, False), (8, 32, False, False), (4, 32, True, True), (8, 16, True, True),
])
def test_matches_reference_on_dequantized_experts(nan_outputs, num_tokens, hidden, inter, num_experts, top_k,
                                                  block_m, bits, group_size, zeros, act_order):
    w13, w2 = _experts(num_experts, hidden, inter, bits, group_size, zeros, act_order)
    x, weights, ids = _routing(num_tokens, hidden, num_experts, top_k)
    out = fused_experts_quant_triton(x, w13, w2, weights, ids, block_m=block_m)
    _check(out, x, w13, w2, weights, ids)


@pytest.mark.parametrize("config", [
    GroupedQuantConfig(block_m=32, block_n=16, block_k=256, num_warps=2, num_stages=2),  # 32 words per K tile
    GroupedQuantConfig(block_m=16, block_n=32, one_dot=True),  # one tl.dot per K tile
])
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (4, 128, False), (8, 64, True)])
def test_launch_config_overrides(nan_outputs, config, bits, group_size, act_order):
    # H = 300, I = 72: not multiples of the K tiles (256 / 128 columns); groups inside one K tile.
    w13, w2 = _experts(3, 300, 72, bits, group_size, True, act_order, seed=4)
    x, weights, ids = _routing(7, 300, 3, 2)
    _check(fused_experts_quant_triton(x, w13, w2, weights, ids, config=config), x, w13, w2, weights, ids)


def test_gelu_and_group_64_and_128():
    w13 = random_quant(2 * 64, 128, 4, 128, True, False, experts=3, device=DEV)
    w2 = random_quant(128, 64, 4, 64, False, False, experts=3, seed=2, device=DEV)
    x, weights, ids = _routing(6, 128, 3, 2)
    _check(fused_experts_quant_triton(x, w13, w2, weights, ids, "gelu"), x, w13, w2, weights, ids, "gelu")


@pytest.mark.parametrize("zeros", [True, False])
def test_ptx_dequant_tile_matches_reference(nan_outputs, zeros):
    # quant_dot.accumulate_dot_tile inside the grouped kernel (plain-Triton math under the interpreter; the PTX
    # on GPUs): K = 256 and 128 are whole K tiles of 128 with one group each; float32 activations.
    w13 = random_quant(2 * 128, 256, 4, 128, zeros, False, experts=3, device=DEV, seed=5)
    w2 = random_quant(256, 128, 4, 128, zeros, False, experts=3, seed=6, device=DEV)
    x, weights, ids = _routing(5, 256, 3, 2)
    out = fused_experts_quant_triton(x, w13, w2, weights, ids, config=GroupedQuantConfig(ptx_deq=True))
    _check(out, x, w13, w2, weights, ids)
    w13_g32 = random_quant(2 * 128, 256, 4, 32, zeros, False, experts=3, device=DEV)  # 4 groups per K tile
    with pytest.raises(ValueError, match="ptx_deq"):
        fused_experts_quant_triton(x, w13_g32, w2, weights, ids, config=GroupedQuantConfig(ptx_deq=True))


def test_float16_activations():
    w13, w2 = _experts(4, 64, 32, 4, 32, True, False, dtype=torch.float16)
    x, weights, ids = _routing(5, 64, 4, 2, dtype=torch.float16)
    _check(fused_experts_quant_triton(x, w13, w2, weights, ids), x, w13, w2, weights, ids, tol=5e-3)


@pytest.mark.parametrize("act_order", [False, True])
def test_tensor_parallel_shards_add_up(act_order):
    # TP of the experts: w13 rows [gate_r; up_r] (column shard of gate and of up), w2 input columns I / 2
    # (row shard); each rank's output is a partial sum of the full one.
    hidden, inter = 64, 64
    w13, w2 = _experts(3, hidden, inter, 4, 16, True, act_order, seed=4)
    x, weights, ids = _routing(7, hidden, 3, 2)
    full = fused_experts_quant_triton(x, w13, w2, weights, ids)
    total = torch.zeros_like(full)
    for rank in range(2):
        gate = column_shard(w13._replace(qweight=w13.qweight[:, :inter], scales=w13.scales[:, :inter],
                                         qzeros=w13.qzeros[:, :inter]), rank, 2)
        up = column_shard(w13._replace(qweight=w13.qweight[:, inter:], scales=w13.scales[:, inter:],
                                       qzeros=w13.qzeros[:, inter:]), rank, 2)
        w13_r = w13._replace(qweight=torch.cat([gate.qweight, up.qweight], 1),
                             scales=torch.cat([gate.scales, up.scales], 1),
                             qzeros=torch.cat([gate.qzeros, up.qzeros], 1))
        w2_r = row_shard(w2, rank, 2)
        assert w2_r.in_features == inter // 2
        total += fused_experts_quant_triton(x, w13_r, w2_r, weights, ids)
    torch.testing.assert_close(total, full, rtol=1e-4, atol=1e-4)


def test_mismatched_expert_shapes_raise_value_error():
    w13, w2 = _experts(3, 64, 32, 4, 32, True, False)
    x, weights, ids = _routing(2, 64, 3, 2)
    with pytest.raises(ValueError, match="do not fit hidden size"):
        fused_experts_quant_triton(x[:, :32], w13._replace(in_features=32, qweight=w13.qweight[..., :4],
                                                           scales=w13.scales[..., :1], qzeros=w13.qzeros[..., :1]),
                                   w2, weights, ids)


# ---------------------------------------------------------------------------------------------------------
# GPU: Qwen3-30B-A3B experts (E = 128, H = 2048, I = 768, top-8), bf16 and the cc-7.0 fp16 setting


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 300, 2048])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group_size,zeros,act_order", [(4, 128, True, False), (4, 128, False, True),
                                                             (8, -1, False, False)])
def test_gpu_qwen3_moe_shapes(num_tokens, dtype, bits, group_size, zeros, act_order):
    w13, w2 = _experts(128, 2048, 768, bits, group_size, zeros, act_order, dtype=dtype)
    x, weights, ids = _routing(num_tokens, 2048, 128, 8, dtype=dtype)
    out = fused_experts_quant_triton(x, w13, w2, weights, ids)
    ref = fused_experts_reference(x.float(), dense(w13, dtype).float(), dense(w2, dtype).float(), weights, ids)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < (2e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_qwen3_moe_shapes_ptx_dequant(num_tokens, dtype):
    w13, w2 = _experts(128, 2048, 768, 4, 128, True, False, dtype=dtype)
    x, weights, ids = _routing(num_tokens, 2048, 128, 8, dtype=dtype)
    out = fused_experts_quant_triton(x, w13, w2, weights, ids, config=GroupedQuantConfig(ptx_deq=True))
    ref = fused_experts_reference(x.float(), dense(w13, dtype).float(), dense(w2, dtype).float(), weights, ids)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < (2e-2 if dtype == torch.bfloat16 else 5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 300])
def test_gpu_qwen3_moe_shapes_cc70_settings(monkeypatch, num_tokens):
    # The cc-7.0 plan (float16, one pipeline stage), as TOKENMILL_FORCE_CC70=1 makes it on this GPU.
    import tokenmill.kernels.triton.fused_moe_quant as moe_quant

    monkeypatch.setattr(moe_quant, "device_facts", lambda device: ((7, 0), 80))
    w13, w2 = _experts(128, 2048, 768, 4, 128, True, False, dtype=torch.float16)
    x, weights, ids = _routing(num_tokens, 2048, 128, 8, dtype=torch.float16)
    out = fused_experts_quant_triton(x, w13, w2, weights, ids)
    ref = fused_experts_reference(x.float(), dense(w13, torch.float16).float(), dense(w2, torch.float16).float(),
                                  weights, ids)
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 5e-3
