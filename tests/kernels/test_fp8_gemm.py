"""FP8 Triton kernels (kernels/triton/fp8_quant.py, fp8_gemm.py, fp8_gemv.py) against the PyTorch references
(kernels/fp8.py) and, for the GEMV, a float64 reference of its own math.

CPU: Triton's interpreter on tiny shapes (TRITON_INTERPRET=1, tests/kernels/conftest.py); `gpu` tests at
real sizes on a CUDA device (4096 x 4096, 14336 x 4096, 128 x 128 blocks, `torch._scaled_mm`).

Error bound, per output element (|ref| the reference's magnitude, P = sum_k |x'[m, k]| |W[n, k]|, the
magnitude sum of the products, x' the (quantized) activations the reference multiplies):

    |y - ref| <= u(dtype) * |ref| + e_acc * P + 1e-6

- u(dtype) = 2^-7 (bfloat16), 2^-10 (float16), 2^-20 (float32): kernel and reference each round a float32
  result to the output dtype once; two nearby float32 values may round one unit apart.
- e_acc: how the float32 sums may differ. Activation quantization is bit-equal (tested separately), and
  fp8 x fp8 and 16-bit x e4m3 products are exact in float32, so only the summation order differs:
  K * 2^-24 < 1e-5 on the interpreter's shapes. GPU tensor cores: 2^-12 (Hopper's fp8 MMA keeps ~14 bits
  of the running sum inside a 128-deep K tile, DeepSeek-V3 report §3.3.2; the kernels add each tile into a
  float32 accumulator). The dequantize + cuBLAS path multiplies the weight rounded to x's dtype:
  e_acc = 2^-8 (bfloat16) / 2^-11 (float16), half a unit of the weight's rounding.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import fp8
from tokenmill.kernels.triton import fp8_gemm, fp8_gemv, splitk
from tokenmill.kernels.triton.fp8_quant import quantize_fp8_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
U = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}


def make_weight(n: int, k: int, scheme: str, block: tuple[int, int] = (128, 128), seed: int = 0) -> fp8.Fp8Weight:
    g = torch.Generator().manual_seed(seed)
    wf = torch.randn(n, k, generator=g) * 0.05
    if scheme == "tensor":
        return fp8.Fp8Weight(*fp8.quantize_fp8_per_tensor(wf))
    if scheme == "channel":
        return fp8.Fp8Weight(*fp8.quantize_fp8_per_row(wf))
    q, s = fp8.quantize_fp8_block(wf, block)
    return fp8.Fp8Weight(q, s, block)


def to(w: fp8.Fp8Weight, device: str) -> fp8.Fp8Weight:
    return fp8.Fp8Weight(w.weight.to(device), w.scale.to(device), w.block_size,
                         None if w.input_scale is None else w.input_scale.to(device))


def assert_gemm_close(y: torch.Tensor, x: torch.Tensor, w: fp8.Fp8Weight, bias, w8a8: bool, e_acc: float) -> None:
    """y within the module docstring's bound of the reference, computed on x's device in float32 (no TF32)."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        ref = fp8.fp8_linear_reference(x, w, bias, w8a8).float()
        xs = fp8.quantize_activations_reference(x, w) if w8a8 else x.float()
        p = xs.abs() @ fp8.dequantize_fp8_weight(w).abs().t()
    finally:
        torch.set_float32_matmul_precision(precision)
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = (y.float() - ref).abs()
    bound = U[x.dtype] * ref.abs() + e_acc * p + 1e-6
    assert bool((err <= bound).all()), f"max err / bound {float((err / bound).max()):.3g}"


# ---------------------------------------------------------------------------------------------------------
# Activation quantization: bit-equal to the reference


@pytest.mark.parametrize(("m", "k", "group"), [(1, 16, None), (3, 40, None), (2, 2500, None), (5, 300, 128),
                                               (4, 130, 64), (1, 2100, 2048), (7, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_quantization_is_bit_equal(m, k, group, dtype):
    torch.manual_seed(m * k)
    x = torch.randn(m, k) * torch.logspace(-4, 2, k)
    x[0, :5] = torch.tensor([0.0, 1e-6, -3e-3, 1e-30, -0.0])  # zeros (both signs), e4m3 subnormals, underflow
    x = x.to(dtype).to(DEVICE)
    q, s = quantize_fp8_triton(x, group)
    rq, rs = fp8.quantize_fp8_per_row(x.cpu()) if group is None else fp8.quantize_fp8_per_group(x.cpu(), group)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s.cpu(), rs)


def test_static_activation_scale_and_strided_input():
    x = (torch.randn(6, 96) * 3).to(DEVICE)[::2, 8:72]  # strided view
    q, s = quantize_fp8_triton(x, scale=torch.tensor(0.005, device=DEVICE))
    rq, _ = fp8.quantize_fp8_per_tensor(x.cpu(), torch.tensor(0.005))
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8)) and s.shape == (1,)
    assert int((q.float().abs() == 448).sum()) > 0  # |x| / 0.005 exceeds 448 for some: saturated, not NaN


def test_bad_activation_inputs_raise():
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        quantize_fp8_triton(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="positive"):
        quantize_fp8_triton(torch.zeros(2, 3), group_size=0)


# ---------------------------------------------------------------------------------------------------------
# GEMMs under the interpreter: every path, tiny shapes


SHAPES = [(1, 40, 64), (3, 33, 200), (17, 70, 130), (40, 24, 96)]


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_w8a8_triton_matches_reference(m, n, k, scheme, dtype):
    w = to(make_weight(n, k, scheme, (32, 32), seed=m), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n)).to(dtype).to(DEVICE)
    bias = torch.randn(n).to(dtype).to(DEVICE) if m % 2 else None
    y = fp8_gemm.fp8_linear_triton(x, w, bias, capability=(9, 0), use_scaled_mm=False)
    assert_gemm_close(y, x, w, bias, True, 2.0 ** -12 if x.is_cuda else 1e-5)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize(("scheme", "block"), [("tensor", None), ("channel", None), ("block", (32, 32)),
                                               ("block", (16, 64))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("capability", [(7, 0), (8, 0)])
def test_weight_only_triton_matches_reference(m, n, k, scheme, block, dtype, capability):
    w = to(make_weight(n, k, scheme, block or (1, 1), seed=k), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    bias = torch.randn(n).to(dtype).to(DEVICE)
    # Thresholds forced so that these shapes reach split-K, the tiled kernel and dequantize + cuBLAS.
    plan = fp8_gemm.plan_fp8_gemm(m, n, k, False, capability, 132, block[1] if block else None,
                                  small_m_max=2, large_m_min=20)
    y = fp8_gemm.fp8_linear_triton(x, w, bias, quantize_activations=False, capability=capability,
                                   small_m_max=2, large_m_min=20)
    cublas = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 1e-5}[dtype]
    assert_gemm_close(y, x, w, bias, False, cublas if plan.path == "cublas" else (2.0 ** -12 if x.is_cuda else 1e-5))


def test_paths_and_tiles_are_planned_by_capability_and_m():
    plan = fp8_gemm.plan_fp8_gemm
    assert plan(4, 4096, 4096, True, (9, 0), 132).path == "triton" and plan(4, 4096, 4096, True, (9, 0), 132).split_k > 1
    assert plan(4096, 4096, 4096, True, (9, 0), 132, 128).block_k == 128
    assert plan(4096, 4096, 4096, False, (9, 0), 132).path == "cublas"
    assert plan(100, 4096, 4096, False, (8, 0), 108).path == "triton"
    small70 = plan(4, 4096, 4096, False, (7, 0), 80, 128)
    assert small70.path == "triton" and not small70.use_dot and small70.num_stages == 1 and 128 % small70.block_k == 0
    assert plan(9, 4096, 4096, False, (7, 0), 80).path == "cublas"
    with pytest.raises(ValueError, match="multiple of 16"):
        plan(1, 64, 64, True, (9, 0), 132, scale_block_k=24)


def test_split_k_matches_one_slice():
    w = to(make_weight(48, 512, "block", (32, 64)), DEVICE)
    x = torch.randn(3, 512).to(DEVICE)
    one = fp8_gemm.fp8_linear_triton(x, w, capability=(9, 0), split_k=1)
    four = fp8_gemm.fp8_linear_triton(x, w, capability=(9, 0), split_k=4)
    assert_gemm_close(four, x, w, None, True, 1e-5 if not x.is_cuda else 2.0 ** -12)
    assert float((one - four).abs().max()) <= 1e-4 * float(one.abs().max())


def test_static_input_scale_with_block_weights():
    w = make_weight(40, 96, "block", (32, 32))
    w = to(fp8.Fp8Weight(w.weight, w.scale, w.block_size, torch.tensor(0.01)), DEVICE)
    x = torch.randn(5, 96, dtype=torch.float16).to(DEVICE)
    y = fp8_gemm.fp8_linear_triton(x, w, capability=(9, 0))
    assert_gemm_close(y, x, w, None, True, 1e-5 if not x.is_cuda else 2.0 ** -12)


def test_dequantize_triton_equals_reference():
    for scheme, block in [("tensor", None), ("channel", None), ("block", (32, 64))]:
        w = to(make_weight(70, 130, scheme, block or (1, 1)), DEVICE)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got = fp8_gemm.dequantize_fp8_triton(w, dtype).cpu()
            assert torch.equal(got, fp8.dequantize_fp8_weight(to(w, "cpu"), dtype))


def test_bad_shapes_raise():
    w = to(make_weight(40, 64, "channel"), DEVICE)
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        fp8_gemm.fp8_linear_triton(torch.zeros(2, 65, device=DEVICE), w)
    bad = fp8.Fp8Weight(w.weight, torch.ones(3, 1, device=DEVICE), (32, 32))
    with pytest.raises(ValueError, match="Block scales"):
        fp8_gemm.fp8_linear_triton(torch.zeros(2, 64, device=DEVICE), bad)


def test_scaled_mm_call_layout_on_cpu_torch():
    """The exact `torch._scaled_mm` call (row-wise scales, W^T as a column-major view) on torch's CPU
    implementation, against the reference: checks the argument layout without a GPU."""
    for scheme in ("tensor", "channel"):
        w = make_weight(48, 64, scheme)
        x = torch.randn(5, 64, dtype=torch.bfloat16)
        xq, xs = fp8.quantize_fp8_per_row(x)
        bias = torch.randn(48, dtype=torch.bfloat16)
        y = fp8_gemm.scaled_mm_rowwise(xq, xs, w, bias, torch.bfloat16)
        assert_gemm_close(y, x, w, bias, True, 1e-5)


def test_entry_points_on_cpu_use_the_reference():
    from tokenmill import kernels

    w = make_weight(24, 64, "block", (16, 32))
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = kernels.fp8_linear(x, w)
    assert y.shape == (2, 3, 24)
    assert torch.equal(y.reshape(6, 24), fp8.fp8_linear_reference(x.reshape(6, 64), w))
    q, s = kernels.quantize_fp8_activations(x.reshape(6, 64), 32)
    assert s.shape == (6, 2) and q.dtype == torch.float8_e4m3fn
    assert torch.equal(kernels.dequantize_fp8_weight(w, torch.float32), fp8.dequantize_fp8_weight(w))


# ---------------------------------------------------------------------------------------------------------
# The GEMV (M <= 4) against a float64 reference of its math: e4m3 codes decoded exactly, scales applied once


def gemv_reference(x: torch.Tensor, w: fp8.Fp8Weight, x_scale: torch.Tensor | None,
                   bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, P) float64 [M, N]: y = s_x * s_w * (x @ q_w^T) (+ bias) with x the e4m3 codes' values (x_scale given)
    or x itself, and P the same sum over |products| (the scale of float32 summation errors)."""
    xv = fp8.e4m3_to_float(x, torch.float64) if x_scale is not None else x.double()
    wv = fp8.e4m3_to_float(w.weight, torch.float64)
    sx = x_scale.double().reshape(-1, 1) if x_scale is not None else torch.ones(1, 1, dtype=torch.float64)
    sw = w.scale.double().reshape(1, -1)
    y = (xv @ wv.t()) * sx * sw
    p = (xv.abs() @ wv.abs().t()) * sx.abs() * sw.abs()
    return (y + bias.double() if bias is not None else y), p


def assert_gemv_close(y: torch.Tensor, ref: torch.Tensor, p: torch.Tensor, k: int) -> None:
    """|y - ref| <= u(dtype) |ref| (one rounding to y's dtype) + K 2^-24 P (float32 summation, exact products)."""
    assert not bool(y.isnan().any()), "an output element was not written"
    err = (y.double().cpu() - ref.cpu()).abs()
    bound = U[y.dtype] * ref.abs().cpu() + k * 2.0 ** -24 * p.cpu() + 1e-30
    assert bool((err <= bound).all()), f"max err / bound {float((err / bound).max()):.3g}"


@pytest.fixture
def nan_outputs(monkeypatch):
    """Outputs and split-K partials start as NaN, so an element the kernels skip fails the comparison."""
    monkeypatch.setattr(fp8_gemv, "_new_output",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


# Every pair of values of (N x K, M, activation mode, scale scheme, split / prefetch) appears at least once (a
# covering array instead of all 192 combinations: the Triton interpreter takes ~0.25 s per launch). N x K: ragged
# N and K tiles, K a multiple of the step.
GEMV_CASES = [
    (70, 200, 1, "token", "tensor", 1, False), (70, 200, 2, "static", "channel", 3, False),
    (70, 200, 3, "weight_only", "tensor", 1, True), (70, 200, 4, "token", "channel", 3, True),
    (33, 256, 1, "static", "channel", 1, True), (33, 256, 2, "weight_only", "tensor", 3, True),
    (33, 256, 3, "token", "channel", 3, False), (33, 256, 4, "static", "tensor", 1, False),
    (70, 200, 1, "weight_only", "channel", 3, False), (33, 256, 2, "token", "tensor", 1, True),
    (70, 200, 3, "static", "tensor", 3, True), (33, 256, 4, "weight_only", "channel", 1, False),
    (33, 256, 1, "token", "tensor", 3, True), (70, 200, 2, "token", "channel", 1, False),
    (33, 256, 3, "weight_only", "channel", 1, False), (70, 200, 4, "static", "channel", 3, True),
    (70, 200, 4, "token", "tensor", 3, False), (33, 256, 4, "weight_only", "tensor", 1, True),
]


@pytest.mark.parametrize(("n", "k", "m", "mode", "scheme", "split_k", "prefetch"), GEMV_CASES)
def test_gemv_matches_float64_reference(n, k, m, mode, scheme, split_k, prefetch, nan_outputs):
    dtype = [torch.bfloat16, torch.float16, torch.float32, torch.bfloat16][m - 1]
    w = to(make_weight(n, k, scheme, seed=m + k), DEVICE)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(n + m)) * 2).to(dtype).to(DEVICE)
    bias = torch.randn(n).to(dtype).to(DEVICE) if split_k == 3 else None
    if mode == "weight_only":
        xa, xs = x, None
    else:
        xa, xs = quantize_fp8_triton(x, scale=torch.tensor(0.01, device=DEVICE) if mode == "static" else None)
    block_m = 4 if m > 2 else m
    y = fp8_gemv.fp8_gemv(xa, w.weight, w.scale, xs, bias, dtype, block_m, 64, 64, split_k, 1, hw_cvt=False,
                          prefetch=prefetch)
    ref, p = gemv_reference(xa.cpu(), to(w, "cpu"), None if xs is None else xs.cpu(),
                            None if bias is None else bias.cpu())
    if mode == "static":
        assert int((xa.float().abs() == 448).sum()) > 0  # |x| / 0.01 saturates some codes: still the same math
    assert_gemv_close(y, ref, p, k)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("quantize", [True, False])
def test_gemv_through_fp8_linear_matches_reference(m, quantize, nan_outputs, monkeypatch):
    """With FP8_GEMV_M_MAX = 2, fp8_linear_triton plans the GEMV for M <= 2 and gets the reference's result (W8A8
    and W8A16), for every capability (cc 7.0: weight-only, integer decoding)."""
    monkeypatch.setattr(fp8_gemm, "FP8_GEMV_M_MAX", 2)
    calls = []
    monkeypatch.setattr(fp8_gemm, "fp8_gemv", lambda *a, **kw: calls.append(a[6:]) or fp8_gemv.fp8_gemv(*a, **kw))
    w = to(make_weight(72, 160, "channel"), DEVICE)
    x = torch.randn(m, 160, dtype=torch.bfloat16).to(DEVICE)
    bias = torch.randn(72, dtype=torch.bfloat16).to(DEVICE)
    for cap in ((9, 0), (8, 0), (7, 0)):
        y = fp8_gemm.fp8_linear_triton(x, w, bias, quantize_activations=quantize, capability=cap)
        assert_gemm_close(y, x, w, bias, quantize and cap >= (8, 9), 2.0 ** -12 if x.is_cuda else 1e-5)
    assert len(calls) == 3 and all(c[0] == m for c in calls)  # block_m


def test_gemv_planning_and_support(monkeypatch):
    plan = fp8_gemm.plan_fp8_gemm
    # Off by default (slower than the split-K GEMM on the H200): decode takes the tl.dot GEMM.
    assert fp8_gemm.FP8_GEMV_M_MAX == 0 and plan(1, 4096, 4096, True, (9, 0), 132).path == "triton"
    monkeypatch.setattr(fp8_gemm, "FP8_GEMV_M_MAX", 2)
    for m in (1, 2):
        p = plan(m, 4096, 4096, True, (9, 0), 132)
        assert p.path == "gemv" and p.block_m == m and p.split_k > 1 and p.block_k % 4 == 0
        assert (p.block_n, p.block_k // 4, p.num_warps, p.prefetch) == fp8_gemm.FP8_GEMV_TILES[m]
    assert plan(1, 28672, 4096, True, (9, 0), 132).split_k < plan(1, 4096, 4096, True, (9, 0), 132).split_k
    assert plan(1, 4096, 4096, False, (7, 0), 80).path == "gemv"  # every capability (integer decoding)
    assert plan(3, 4096, 4096, True, (9, 0), 132).path == "triton"  # above FP8_GEMV_M_MAX
    assert plan(3, 4096, 4096, True, (9, 0), 132, gemv_m_max=4).block_m == 4
    assert plan(1, 4096, 4096, True, (9, 0), 132, scale_block_k=128).path == "triton"  # block scales
    assert plan(1, 4096, 4098, False, (9, 0), 132).path == "triton"  # K not a multiple of 4
    assert plan(1, 4096, 4096, True, (9, 0), 132, gemv_m_max=0).path == "triton"
    q = make_weight(8, 64, "channel").weight
    assert fp8_gemv.gemv_supported(q, None) and fp8_gemv.gemv_supported(q.view(torch.uint8)[:, 4:], None)
    assert not fp8_gemv.gemv_supported(q, (128, 128))
    assert not fp8_gemv.gemv_supported(q[:, 1:], None) and not fp8_gemv.gemv_supported(q[:, 2:6], None)
    assert not fp8_gemv.gemv_supported(q.t(), None)


def test_gemv_skips_block_weights_and_rejects_bad_launches(monkeypatch):
    calls = []
    monkeypatch.setattr(fp8_gemm, "fp8_gemv", lambda *a, **kw: calls.append(1) or fp8_gemv.fp8_gemv(*a, **kw))
    w = to(make_weight(40, 64, "block", (32, 32)), DEVICE)
    x = torch.randn(1, 64).to(DEVICE)
    assert_gemm_close(fp8_gemm.fp8_linear_triton(x, w, capability=(9, 0)), x, w, None, True, 1e-5 if not x.is_cuda
                      else 2.0 ** -12)
    assert calls == []
    wc = to(make_weight(40, 64, "channel"), DEVICE)
    with pytest.raises(ValueError, match="block_m"):
        fp8_gemv.fp8_gemv(torch.randn(3, 64).to(DEVICE), wc.weight, wc.scale, None, None, torch.float32, 2, 64, 64,
                          1, 1, hw_cvt=False)
    with pytest.raises(ValueError, match="multiple of 4"):
        fp8_gemv.fp8_gemv(torch.randn(1, 63).to(DEVICE), wc.weight[:, :63], wc.scale, None, None, torch.float32, 1,
                          64, 64, 1, 1, hw_cvt=False)


# ---------------------------------------------------------------------------------------------------------
# GPU at real sizes


# FP8 tensor-core products (sm_89 / sm_90: cuBLAS's _scaled_mm and Triton's fp8 tl.dot) are not summed in
# IEEE float32: inside each MMA the products are aligned to the largest exponent and kept to ~14 bits
# (DeepSeek-V3 report, section 3.3.2, measured on H800), so each 32-deep step loses up to ~2^-13 of its
# largest product, with the same sign (truncation), before the float32 promotion. Over K that adds up to
# about 2^-13 * (max / mean product) of sum |x| |w|; random data has max / mean ~ 8 per step: 2^-10. Bound
# 2^-8 (the H200 gave up to 2^-9.7 at these sizes, session 9); a wrong scale or tile is off by O(1). Since
# session 12 `_scaled_mm` (M > SMALL_M_MAX) runs with fast accumulation, no promotion inside the K loop; the same
# bound held on the H200 at M = 200 and 1000, K up to 14336 (benchmarks/gpu/results/session12/visit3).
E_ACC_FP8_MMA = 2.0 ** -8


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (14336, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 16, 200, 1000])
def test_gpu_real_sizes(m, n, k):
    torch.manual_seed(0)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    for scheme in ("channel", "block"):
        w = to(make_weight(n, k, scheme), "cuda")
        if splitk.device_facts(x.device)[0] >= (8, 9):  # the effective capability (TOKENMILL_FORCE_CC70=1: 7.0)
            y = fp8_gemm.fp8_linear_triton(x, w)  # per-channel: Triton up to SMALL_M_MAX, then _scaled_mm
            assert_gemm_close(y, x, w, None, True, E_ACC_FP8_MMA)
            y = fp8_gemm.fp8_linear_triton(x, w, use_scaled_mm=False)
            assert_gemm_close(y, x, w, None, True, E_ACC_FP8_MMA)
        y = fp8_gemm.fp8_linear_triton(x, w, quantize_activations=False)
        e = 2.0 ** -8 if m > fp8_gemm.LARGE_M_MIN else 2.0 ** -12
        assert_gemm_close(y, x, w, None, False, e)
        y = fp8_gemm.fp8_linear_triton(x.half(), w, quantize_activations=False, capability=(7, 0))
        assert_gemm_close(y, x.half(), w, None, False, 2.0 ** -11 if m > fp8_gemm.SMALL_M_MAX_CC70 else 2.0 ** -12)


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "k", "scheme"), [(6144, 4096, "channel"), (4096, 4096, "tensor"),
                                                (28672, 4096, "channel"), (4096, 14336, "channel")])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_gpu_gemv_llama_shapes(n, k, scheme, m, nan_outputs):
    """The GEMV at Llama-3.1-8B's linear shapes with the planned tiles (FP8_GEMV_TILES, also for M = 4) against
    the float64 reference of its math: W8A8 per-token and static x, W8A16 bfloat16 x; the PTX conversion
    (cc >= 8.9) and the integer decoding, with and without the prefetch."""
    torch.manual_seed(0)
    w = to(make_weight(n, k, scheme), "cuda")
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    cap, sms = splitk.device_facts(x.device)
    plan = fp8_gemm.plan_fp8_gemm(m, n, k, True, cap, sms, gemv_m_max=4)
    assert plan.path == "gemv"
    inputs = [quantize_fp8_triton(x), quantize_fp8_triton(x, scale=torch.tensor(0.02, device="cuda")), (x, None)]
    w_cpu = to(w, "cpu")
    for xa, xs in inputs:
        ref, p = gemv_reference(xa.cpu(), w_cpu, None if xs is None else xs.cpu(), None)
        for hw in (True, False) if cap >= (8, 9) else (False,):
            for prefetch in (plan.prefetch, not plan.prefetch):
                y = fp8_gemv.fp8_gemv(xa, w.weight, w.scale, xs, None, torch.bfloat16, plan.block_m, plan.block_n,
                                      plan.block_k, plan.split_k, plan.num_warps, hw, prefetch)
                assert_gemv_close(y, ref, p, k)


@pytest.mark.gpu
def test_gpu_quantization_bit_equal_at_real_size():
    x = torch.randn(1000, 14336, dtype=torch.bfloat16, device="cuda")
    for group in (None, 128):
        q, s = quantize_fp8_triton(x, group)
        rq, rs = fp8.quantize_fp8_per_row(x) if group is None else fp8.quantize_fp8_per_group(x, group)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)


@pytest.mark.gpu
def test_gpu_forced_cc70_takes_the_weight_only_paths(monkeypatch):
    """TOKENMILL_FORCE_CC70=1 (platforms.cuda.effective_capability): no W8A8 even where FP8 arithmetic exists;
    fp16 decode runs the FMA split-K kernel, larger M dequantize + cuBLAS; both match the weight-only reference."""
    from tokenmill import kernels

    monkeypatch.setenv("TOKENMILL_FORCE_CC70", "1")
    splitk._device_facts.cache_clear()
    try:
        assert splitk.device_facts(torch.device("cuda"))[0] == (7, 0)
        w = to(make_weight(4096, 4096, "block"), "cuda")
        for m in (1, 8, 64):
            x = torch.randn(2, m, 4096, dtype=torch.float16, device="cuda")
            y = kernels.fp8_linear(x, w)  # W8A8 requested, weight-only on cc 7.0
            assert y.shape == (2, m, 4096)
            assert_gemm_close(y.reshape(-1, 4096), x.reshape(-1, 4096), w, None, False,
                              2.0 ** -11 if 2 * m > fp8_gemm.SMALL_M_MAX_CC70 else 2.0 ** -12)
    finally:
        splitk._device_facts.cache_clear()
