"""Triton int4/int8 weight-only linear (`kernels/triton/quant_linear.py`) vs dequantize-then-matmul.

CPU: the Triton interpreter (conftest.py), tiny shapes, every path reached by
overriding the M thresholds (`small_m_max`, `large_m_min`) or the planned
capability (cc 7.0). The interpreter's bfloat16 `tl.dot` is wrong (it
returns garbage for bf16 operands even without our code), so bfloat16 runs
on CPU only through the paths without tl.dot (cc 7.0 split-K, cuBLAS); the
GPU tests cover it at real sizes.
"""

from __future__ import annotations

import pytest
import torch
from quant_helpers import column_shard, dense, random_quant, row_shard

from tokenmill.kernels.quant_pack import QuantTensors
from tokenmill.kernels.triton import quant_linear as ql
from tokenmill.kernels.triton import splitk

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

# Keyword overrides that force each path on tiny shapes (M <= 40 below).
PATHS = {
    # The GEMV kernel serves M = 1 on cc < 8.0 only (the H200 sweep: split-K won every M on cc 9.0), so the
    # matrix runs it under the cc-7.0 plan; test_gemv_rows_one_to_three covers its row and group cases.
    "gemv_cc70": dict(gemv_m_max=64, capability=(7, 0)),
    "splitk": dict(small_m_max=64, gemv_m_max=0),
    "splitk_cc70": dict(small_m_max=64, gemv_m_max=0, capability=(7, 0)),
    "tiled": dict(small_m_max=0, large_m_min=1 << 20, gemv_m_max=0),
    "cublas": dict(small_m_max=0, large_m_min=0, gemv_m_max=0),
    "cublas_cc70": dict(small_m_max=0, gemv_m_max=0, capability=(7, 0)),
}


def _reference(x: torch.Tensor, w: QuantTensors, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ dense(w, x.dtype).double().t()
    return y + bias.double() if bias is not None else y


def _check(y: torch.Tensor, x: torch.Tensor, w: QuantTensors, bias: torch.Tensor | None = None) -> None:
    ref = _reference(x, w, bias)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[x.dtype]
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.fixture
def nan_outputs(monkeypatch):
    """Output buffers start as NaN, so an element the kernels skip fails the comparison."""
    def new_output(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(ql, "_new_output", new_output)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("bits,group_size,zeros,act_order", [
    (4, 32, True, False), (4, 64, False, False), (4, 128, True, False), (4, -1, False, False),
    (8, 32, False, False), (8, -1, True, False), (4, 32, True, True), (8, 64, False, True),
])
def test_paths_match_dequantize_then_matmul(nan_outputs, path, bits, group_size, zeros, act_order):
    # K = 200: not a multiple of any tile, nor of p (4-bit: last word holds 0 of 8 ... ; 8-bit: 2 of 4 used),
    # N = 37: not a multiple of the N tiles.
    n, k = 37, 200 if group_size != 128 else 300
    w = random_quant(n, k, bits, group_size, zeros, act_order, device=DEV, seed=bits + group_size)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEV)
    # The GEMV kernel serves M = 1 (it loops over rows): 1 and 3 rows cover it; the tiled paths take 17 and 40 too.
    # cc-7.0 split-K serves M = 1 only by default (act-order weights; larger M goes to cuBLAS): 1 and 3 rows.
    for m in ((1, 3) if path.startswith("gemv") or path == "splitk_cc70" else (1, 3, 17, 40)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
        _check(ql.quant_linear(x, w, bias, **PATHS[path]), x, w, bias)
    _check(ql.quant_linear(x, w, None, **PATHS[path]), x, w, None)


@pytest.mark.parametrize("m", [1, 16, 17, 300])
def test_default_thresholds_a_few_hundred_rows(nan_outputs, m):
    # Default plan at cc 9.0 (the interpreter's device facts; group 32 rules out the tensor-core GEMV): split-K
    # up to 32 rows, then the tiled GEMM up to 64 and dequantize + cuBLAS above (300 rows); large_m_min = 256
    # keeps 300 rows on cuBLAS too.
    w = random_quant(37, 200, 4, 32, True, False, device=DEV, seed=m)
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)).to(DEV)
    _check(ql.quant_linear(x, w, capability=(9, 0)), x, w)
    if m == 300:
        _check(ql.quant_linear(x, w, large_m_min=256, capability=(9, 0)), x, w)


@pytest.mark.parametrize("path", ["gemv_cc70", "splitk", "splitk_cc70", "tiled", "cublas_cc70"])
def test_k_not_a_multiple_of_the_pack_factor(nan_outputs, path):
    # K = 45 with 4-bit: the last word carries 5 values and 3 zero nibbles; group 32 leaves a short last group.
    w = random_quant(19, 45, 4, 32, True, False, device=DEV, seed=3)
    x = torch.randn(5, 45, generator=torch.Generator().manual_seed(0)).to(DEV)
    _check(ql.quant_linear(x, w, **PATHS[path]), x, w)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_half_precision_activations(nan_outputs, dtype, path):
    if dtype == torch.bfloat16 and not CUDA and path in ("splitk", "tiled"):
        pytest.skip("the Triton interpreter's bfloat16 tl.dot is wrong (module docstring); covered on GPU")
    w = random_quant(40, 160, 4, 32, True, False, dtype=dtype, device=DEV, seed=5)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(1)).to(DEV, dtype)
    x = torch.randn(6, 160, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    _check(ql.quant_linear(x, w, bias, **PATHS[path]), x, w, bias)


@pytest.mark.parametrize("split_k", [1, 2, 3, 7])
def test_split_k_slices_sum_to_the_whole(nan_outputs, split_k):
    w = random_quant(24, 512, 4, 64, True, False, device=DEV, seed=7)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(3)).to(DEV)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(4)).to(DEV)
    _check(ql.quant_linear(x, w, bias, split_k=split_k), x, w, bias)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("path", ["splitk", "tiled", "splitk_cc70"])
def test_tensor_parallel_shards_add_up(nan_outputs, act_order, path):
    # Row-parallel: each rank holds K/2 inputs (strided views of qweight / group columns, or all groups
    # plus a slice of g_idx); the partial products sum to the full product. Column-parallel: row slices.
    w = random_quant(24, 256, 4, 32, True, act_order, device=DEV, seed=11)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(DEV)
    total = torch.zeros(3, 24, dtype=torch.float64, device=DEV)
    for rank in range(2):
        shard = row_shard(w, rank, 2)
        assert not shard.qweight.is_contiguous()
        xs = x[:, rank * 128:(rank + 1) * 128]
        y = ql.quant_linear(xs, shard, **PATHS[path])
        torch.testing.assert_close(dense(shard), dense(w)[:, rank * 128:(rank + 1) * 128])
        _check(y, xs, shard)
        total += y.double()
    torch.testing.assert_close(total, _reference(x, w, None), rtol=1e-5, atol=1e-5)
    for rank in range(2):
        shard = column_shard(w, rank, 2)
        _check(ql.quant_linear(x, shard, **PATHS[path]), x, shard)


@pytest.mark.parametrize("bits,group_size,act_order,experts", [
    (4, 32, False, None), (8, -1, False, None), (4, 16, True, None), (4, 64, False, 3), (8, 32, True, 2),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dequantize_weight_equals_reference(nan_outputs, bits, group_size, act_order, experts, dtype):
    w = random_quant(33, 100, bits, group_size, True, act_order, dtype=dtype, experts=experts, device=DEV)
    out = ql.dequantize_weight(w, dtype)
    if dtype == torch.bfloat16 and not CUDA:  # the interpreter truncates float32 -> bfloat16 (GPUs round)
        torch.testing.assert_close(out, dense(w, dtype), rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, dense(w, dtype))  # same float32 product, one rounding


def test_symmetric_zero_point_is_the_midpoint():
    # Symmetric 4-bit: code 8 is zero, code 15 is +7 * scale, code 0 is -8 * scale.
    qweight = torch.tensor([[0x0000F008]], dtype=torch.int32)  # codes k=0..7: 8, 0, 0, 15, 0, 0, 0, 0
    w = QuantTensors(qweight.to(DEV), torch.tensor([[0.5]], device=DEV), None, None, 4, -1, 5)
    out = ql.dequantize_weight(w, torch.float32)
    assert out.tolist() == [[0.0, -4.0, -4.0, 3.5, -4.0]]
    x = torch.tensor([[1.0, 0.0, 0.0, 2.0, 0.0]], device=DEV)
    assert ql.quant_linear(x, w).tolist() == [[7.0]]


def test_plan_thresholds_and_split_k():
    w = random_quant(8, 4096, 4, 128, True, False)  # planning reads shapes only
    w = w._replace(in_features=4096)
    plan = lambda m, n, cc: ql.plan_quant_linear(m, n, w, cc, 132)  # noqa: E731
    # The thresholds of the H200 sweep (quant_linear.py's constants).
    assert [plan(m, 4096, (9, 0)).path for m in (1, 2, 4, 5, 16, 32, 33, 64, 65, 1025)] == \
        ["gemv", "dot", "dot", "dot", "dot", "dot", "dot", "dot", "cublas", "cublas"]
    assert [plan(m, 4096, (7, 0)).path for m in (1, 2, 8, 300)] == ["gemv", "cublas", "cublas", "cublas"]
    assert plan(17, 4096, (9, 0)).block_m == 32 and plan(33, 4096, (9, 0)).block_n == 128
    # Weights the tensor-core GEMV does not take (act-order, 8-bit) keep split-K / tiled.
    act = w._replace(g_idx=torch.zeros(4096, dtype=torch.int32))
    assert [ql.plan_quant_linear(m, 4096, act, (9, 0), 132).path for m in (2, 32, 33, 64)] == \
        ["splitk", "splitk", "tiled", "tiled"]
    # M = 2 for weights the GEMV takes but the tensor-core GEMV does not (8-bit, group 32): the GEMV.
    assert ql.plan_quant_linear(2, 4096, w._replace(bits=8), (9, 0), 132).path == "gemv"
    assert ql.plan_quant_linear(2, 4096, w._replace(group_size=32), (9, 0), 132).path == "gemv"
    assert ql.plan_quant_linear(3, 4096, w._replace(group_size=32), (9, 0), 132).path == "splitk"
    assert ql.plan_quant_linear(5, 4096, act, (9, 0), 132).use_dot
    assert ql.plan_quant_linear(17, 4096, act, (9, 0), 132).block_m == 32
    assert plan(1, 4096, (7, 0)).num_stages == 1 and plan(1, 4096, (9, 0)).block_n == ql.GEMV_BLOCK_N
    gemv = ql.plan_quant_linear(3, 4096, w, (9, 0), 132, gemv_m_max=4)
    assert gemv.block_m == 4  # the GEMV loops over a power of two of rows
    gemv = ql.plan_quant_linear(1, 4096, w, (9, 0), 132, gemv_m_max=4)
    assert gemv.split_k > 1 and (gemv.split_k - 1) * -(-32 // gemv.split_k) < 32  # 4096 / 128: 32 K tiles
    decode = ql.plan_quant_linear(5, 4096, act, (9, 0), 132)
    assert decode.split_k > 1 and decode.block_k == 128  # 64 N tiles alone would leave SMs idle
    k_tiles = 4096 // decode.block_k
    per = -(-k_tiles // decode.split_k)
    assert (decode.split_k - 1) * per < k_tiles  # no empty K slice
    assert ql.plan_quant_linear(5, 28672, act, (9, 0), 132).split_k <= 2  # 224 N tiles of 128 nearly fill the GPU
    assert plan(64, 4096, (9, 0)).block_k == 128 and plan(64, 4096, (9, 0)).block_m == 64
    assert ql.plan_quant_linear(5, 4096, w._replace(bits=8), (9, 0), 132).block_k == 64  # 16 words of 4 values
    assert ql.plan_quant_linear(1, 4096, w._replace(bits=8), (9, 0), 132, gemv_m_max=4).block_k == 4 * ql.GEMV_BLOCK_KW


@pytest.mark.parametrize("bits,group_size,zeros", [
    (4, 32, True), (4, 64, False), (4, 128, True), (4, -1, True), (8, 32, False), (8, 128, True), (8, -1, False),
])
@pytest.mark.parametrize("block_kw", [16])  # the default tile; 4-word tiles: test_gemv_four_word_tiles
def test_gemv_rows_one_to_three(nan_outputs, bits, group_size, zeros, block_kw, k=300, prefetch=False):
    # K = 300: not a multiple of any K step (4 words: 16 / 32 columns per step puts a group boundary inside the
    # tile for group 32 -> per-word groups; 16 words: 64 / 128 columns), N = 21 not a multiple of BLOCK_N 8.
    n = 21
    w = random_quant(n, k, bits, group_size, zeros, False, device=DEV, seed=bits * group_size + block_kw)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(5)).to(DEV)
    p = 32 // bits
    for m, split_k in ((1, 1), (1, 3), (2, 3), (3, 1)):  # one row and a padded power-of-two tile, K split or not
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
        plan = ql.QuantLinearPlan("gemv", block_m=4 if m > 2 else m, block_n=8, block_k=block_kw * p,
                                  split_k=split_k, use_dot=False, num_warps=2, prefetch=prefetch)
        _check(ql.quant_linear(x, w, bias if m % 2 else None, plan=plan), x, w, bias if m % 2 else None)


def test_gemv_four_word_tiles(nan_outputs):
    # 4-word K steps (32 columns of 4-bit) put group-32 boundaries at every step and split group 64 / -1
    # over several steps (per-tile groups); 32-word steps hold several group-32 / 64 groups (per-word groups).
    # K = 256 is a whole number of 16-word steps: the unmasked (EVEN_K) loop. K = 140 (4-bit, 4 words): four
    # whole 32-column steps and a 12-column partial one, split 2 + 2 + 1 over split_k = 3 (the interpreter's cost
    # grows with the steps; K = 300 took ten).
    for bits, group_size, zeros, block_kw, k in ((4, 32, True, 4, 140), (8, 64, True, 32, 300),
                                                 (4, 128, True, 16, 256), (8, -1, False, 16, 256)):
        test_gemv_rows_one_to_three(nan_outputs, bits, group_size, zeros, block_kw, k)


def test_gemv_prefetch(nan_outputs):
    # The register prefetch of the next K step: the unmasked loop (K = 256, 16-word steps: the last step's
    # prefetch is masked off by a scalar) and the masked one (K = 140, 4 words, a partial last step).
    for bits, group_size, zeros, block_kw, k in ((4, 128, True, 16, 256), (4, 32, True, 4, 140)):
        test_gemv_rows_one_to_three(nan_outputs, bits, group_size, zeros, block_kw, k, prefetch=True)


def test_gemv_prefetch_switch_reaches_the_plan(monkeypatch):
    w = random_quant(64, 256, 4, 128, True, False, device=DEV)
    assert not ql.plan_quant_linear(1, 64, w, (9, 0), 132).prefetch
    monkeypatch.setattr(ql, "GEMV_PREFETCH", True)
    plan = ql.plan_quant_linear(1, 64, w, (9, 0), 132)
    assert plan.path == "gemv" and plan.prefetch


def test_gemv_refuses_act_order_and_the_planner_routes_around_it():
    w = random_quant(8, 64, 4, 32, True, True, device=DEV)
    x = torch.randn(1, 64).to(DEV)
    with pytest.raises(ValueError, match="act-order"):
        ql.quant_linear(x, w, plan=ql.QuantLinearPlan("gemv", 1, 8, 64, 1, False))
    assert ql.plan_quant_linear(1, 8, w, (9, 0), 132, gemv_m_max=4).path != "gemv"
    _check(ql.quant_linear(x, w, gemv_m_max=4), x, w)


def test_gemv_plan_needs_block_m_at_least_m():
    w = random_quant(8, 64, 4, 32, True, False, device=DEV)
    with pytest.raises(ValueError, match="block_m"):
        ql.quant_linear(torch.randn(3, 64).to(DEV), w, plan=ql.QuantLinearPlan("gemv", 2, 8, 64, 1, False))


@pytest.mark.parametrize("path", ["splitk", "tiled"])
@pytest.mark.parametrize("bits,group_size,act_order", [(4, 128, False), (4, 32, False), (8, 64, True), (4, 50, False)])
def test_one_dot_variant(nan_outputs, path, bits, group_size, act_order):
    # The single-tl.dot tile (float32 activations: the interpreter's bfloat16 dot is wrong).
    w = random_quant(37, 300, bits, group_size, True, act_order, device=DEV, seed=11)
    x = torch.randn(20, 300, generator=torch.Generator().manual_seed(6)).to(DEV)
    bk = 16 * (32 // bits)
    plan = ql.QuantLinearPlan(path, block_m=16 if path == "splitk" else 32, block_n=32, block_k=bk,
                              split_k=2 if path == "splitk" else 1, one_dot=True)
    _check(ql.quant_linear(x, w, plan=plan), x, w)


def test_kernel_group_modes():
    w = random_quant(8, 512, 4, 128, True, False)
    assert ql.kernel_groups(w, 128)[:2] == (0, 128)  # one group per K tile
    assert ql.kernel_groups(w._replace(group_size=-1), 128)[:2] == (0, 512)
    assert ql.kernel_groups(w._replace(group_size=32), 128)[:2] == (1, 32)  # a group per 4 packed words
    mode, g, g_idx = ql.kernel_groups(w._replace(group_size=12), 128)  # not a multiple of p = 8: gather k // 12
    assert (mode, g) == (2, 12) and g_idx.tolist() == [k // 12 for k in range(512)]
    assert ql.kernel_groups(w._replace(group_size=12), 64, packed_groups=False)[:2] == (1, 12)


@pytest.mark.parametrize("path", ["splitk", "splitk_cc70", "tiled"])
def test_group_size_not_a_multiple_of_the_pack_factor(nan_outputs, path):
    w = random_quant(21, 100, 4, 12, True, False, device=DEV, seed=9)
    x = torch.randn(3, 100, generator=torch.Generator().manual_seed(0)).to(DEV)
    _check(ql.quant_linear(x, w, **PATHS[path]), x, w)
    assert torch.equal(ql.dequantize_weight(w, torch.float32), dense(w))


def test_leading_dims_and_empty_inputs():
    w = random_quant(10, 64, 4, 32, True, False, device=DEV)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)).to(DEV)
    y = ql.quant_linear(x, w)
    assert y.shape == (2, 3, 10)
    _check(y.reshape(6, 10), x.reshape(6, 64), w)
    assert ql.quant_linear(x[:0], w).shape == (0, 3, 10)


def test_bad_inputs_raise_value_error():
    w = random_quant(8, 64, 4, 32, True, False)
    with pytest.raises(ValueError, match="x must be"):
        ql.quant_linear(torch.randn(2, 63), w)
    with pytest.raises(ValueError, match="words per row"):
        ql.quant_linear(torch.randn(2, 64), w._replace(in_features=80))
    with pytest.raises(ValueError, match="scales"):
        ql.quant_linear(torch.randn(2, 64), w._replace(scales=w.scales[:, :1]))
    with pytest.raises(ValueError, match="bias must be"):
        ql.quant_linear(torch.randn(2, 64), w, torch.zeros(7))
    with pytest.raises(ValueError, match="4 or 8"):
        ql.quant_linear(torch.randn(2, 64), w._replace(bits=3))


# ---------------------------------------------------------------------------------------------------------
# GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group_size,zeros,act_order", [
    (4, 128, True, False), (4, 128, False, True), (8, -1, False, False), (4, 32, True, False),
])
def test_gpu_real_sizes_every_path(dtype, n, k, bits, group_size, zeros, act_order):
    w = random_quant(n, k, bits, group_size, zeros, act_order, dtype=dtype, device="cuda")
    ref_w = dense(w, dtype)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for cc in ((9, 0), (7, 0)):
        if cc == (9, 0) and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            continue
        for m in (1, 5, 16, 64, 300, 1100, 4096):
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            y = ql.quant_linear(x, w, bias, capability=cc)
            ref = x.float() @ ref_w.float().t() + bias.float()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (cc, m, err)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zeros", [True, False])
def test_gpu_tensor_core_gemv_real_sizes(dtype, n, k, zeros):
    # The PTX dequantization (quant_dot.py) against dequantize-then-matmul, every decode M up to 64.
    w = random_quant(n, k, 4, 128, zeros, False, dtype=dtype, device="cuda")
    ref_w = dense(w, dtype).float()
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (1, 7, 16, 33, 64):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        plan = ql.QuantLinearPlan("dot", block_m=max(16, 1 << (m - 1).bit_length()), block_n=128, block_k=128,
                                  num_warps=4, num_stages=4)
        y = ql.quant_linear(x, w, bias, plan=plan)
        ref = x.float() @ ref_w.t() + bias.float()
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 2e-3), (m, err)


@pytest.mark.gpu
def test_gpu_force_cc70_env_takes_the_cc70_plan(monkeypatch):
    monkeypatch.setenv("TOKENMILL_FORCE_CC70", "1")
    splitk._device_facts.cache_clear()
    try:
        cap, _ = splitk.device_facts(torch.device("cuda"))
        assert cap == (7, 0)
    finally:
        monkeypatch.delenv("TOKENMILL_FORCE_CC70")
        splitk._device_facts.cache_clear()


@pytest.mark.gpu
def test_gpu_decode_is_cuda_graph_safe():
    w = random_quant(4096, 4096, 4, 128, True, False, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    ql.quant_linear(x, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ql.quant_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref = x.float() @ dense(w, torch.bfloat16).float().t()
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2


@pytest.mark.parametrize("group_size,zeros,k", [(128, True, 256), (64, False, 192), (-1, True, 128)])
def test_tensor_core_gemv_matches_dequantize_then_matmul(nan_outputs, group_size, zeros, k):
    # quant_dot.py: one group per K tile (block_k 64 here divides the group size), nibble-permuted K order on
    # both sides; under the interpreter the plain-Triton dequantization (the PTX one runs on GPUs), float32 x
    # (the interpreter's bfloat16 tl.dot is wrong; the GPU tests cover bf16/fp16). M from 1 to 20 (two M tiles
    # of 16), N = 37 not a multiple of BLOCK_N, split-K 1 and 2.
    w = random_quant(37, k, 4, group_size, zeros, False, device=DEV, seed=k + group_size)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(2)).to(DEV)
    for m, split_k in ((1, 1), (3, 2), (20, 2)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
        plan = ql.QuantLinearPlan("dot", block_m=16, block_n=32, block_k=64, split_k=split_k, num_warps=4)
        _check(ql.quant_linear(x, w, bias if m != 3 else None, plan=plan), x, w, bias if m != 3 else None)


def test_tensor_core_gemv_refuses_weights_it_cannot_take(monkeypatch):
    w = random_quant(8, 256, 4, 32, True, False, device=DEV)  # group 32 < block_k 64
    with pytest.raises(ValueError, match="tensor-core GEMV"):
        ql.quant_linear(torch.randn(1, 256).to(DEV), w, plan=ql.QuantLinearPlan("dot", 16, 32, 64, 1))
    # With the path switched on, the planner takes it for group 128 at K = 256 and routes group 32 around it.
    monkeypatch.setattr(ql, "DOT_M_MAX", 32)
    assert ql.plan_quant_linear(4, 8, w, (9, 0), 132).path == "splitk"
    w128 = random_quant(8, 256, 4, 128, True, False, device=DEV)
    assert ql.plan_quant_linear(4, 8, w128, (9, 0), 132).path == "dot"
    assert ql.plan_quant_linear(4, 8, w128, (7, 0), 132).path != "dot"  # no tensor cores for it on cc 7.0
