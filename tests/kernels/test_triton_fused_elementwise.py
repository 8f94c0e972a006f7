"""Fused Triton RMSNorm / RoPE / gated activations vs the layers' PyTorch paths.

On CPU the kernels run in Triton's interpreter (tiny shapes; seconds). The
reference is each layer's `forward_torch` (the CPU path itself).

Exactness: RoPE, the residual sum and the bfloat16/float16 rounding helper
are bit-exact (same operations, same roundings). RMSNorm's sum of squares
is reduced in another order than PyTorch's, so its float32 rsqrt may differ
in the last bit, which after rounding flips at most an ulp or two of the
output in rare elements. The activations' exp/tanh/erf are NumPy's in the
interpreter and Sleef's in PyTorch's CPU kernels (about an ulp of float32
apart), with the same effect. Those get `rtol = 2 ulp of the dtype` and, in
16-bit dtypes, "almost every element exactly equal".
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tokenmill import kernels
from tokenmill.kernels import _fused_kernels_available, use_fused_kernels
from tokenmill.kernels.moe_activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, act_and_mul
from tokenmill.kernels.triton.activation import gelu_and_mul, silu_and_mul, swiglu_oai_and_mul
from tokenmill.kernels.triton.numerics import round_code, round_to
from tokenmill.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from tokenmill.kernels.triton.rotary import rotary_embedding
from tokenmill.layers.activation import GeluAndMul, SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# Unit in the last place relative to a value in [1, 2): 2^-(stored significand bits).
ULP = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0, min_exact: float = 0.95,
           abs_scale: float = 1e-3) -> None:
    """Within `ulps` ulp of the dtype (relative; absolute: ulps of `abs_scale`), and in 16-bit dtypes mostly bit-equal."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.cpu(), want.cpu()
    # float32: 8x, as the reduction order of the squares moves rsqrt by a few ulp in every element.
    tol = ulps * ULP[want.dtype] * (8 if want.dtype == torch.float32 else 1)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * abs_scale)
    if want.dtype != torch.float32:
        exact = (got == want).float().mean().item()
        assert exact >= min_exact, f"only {exact:.1%} of elements bit-equal"


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- rounding helper ---------------------------------------------------------------------------


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_to(x, ROUND), mask=offs < n)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # NumPy: 3e38 -> fp16 inf
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_round_to_matches_torch_casts(dtype):
    # Random bit patterns (every exponent) plus ties, overflow, inf, NaN, subnormals and signed zeros.
    bits = torch.randint(-(2**31), 2**31 - 1, (2048,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11,
                             3.0e38, -3.4e38, 65519.0, 65520.0, float("inf"), float("-inf"), float("nan"), 1e-40,
                             -1e-45, 6e-8, 3e-5])
    x = torch.cat([bits.to(torch.int32).view(torch.float32), specials]).to(DEVICE)
    out = torch.empty_like(x)
    _round_kernel[(triton.cdiv(x.numel(), 512),)](x, out, x.numel(), ROUND=round_code(dtype), BLOCK=512)
    want = x.to(dtype).float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan], want[~nan])


# --- RMSNorm -----------------------------------------------------------------------------------


def _rms_layer(n: int, dtype: torch.dtype, gemma: bool, seed: int) -> RMSNorm:
    layer = RMSNorm(n, eps=1e-6, gemma=gemma).to(dtype)
    layer.weight.data = _randn(n, dtype=dtype, seed=seed) * (0.3 if gemma else 1.0)
    return layer.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("n", [48, 64])
def test_rms_norm(dtype, gemma, n):
    layer = _rms_layer(n, dtype, gemma, seed=n)
    x = (_randn(5, n, dtype=dtype, seed=1) * 3).to(DEVICE)
    _close(rms_norm(x, layer.weight, layer.eps, gemma), layer.forward_torch(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fused_add_rms_norm(dtype, gemma):
    n = 40
    layer = _rms_layer(n, dtype, gemma, seed=2)
    x = _randn(6, n, dtype=dtype, seed=3).to(DEVICE)
    residual = (_randn(6, n, dtype=dtype, seed=4) * 4).to(DEVICE)
    x_before, residual_before = x.clone(), residual.clone()
    normed, new_residual = fused_add_rms_norm(x, residual, layer.weight, layer.eps, gemma)
    want_normed, want_residual = layer.forward_torch(x, residual)
    assert torch.equal(new_residual, want_residual), "x + residual must round exactly as PyTorch's add"
    _close(normed, want_normed)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("gemma", [False, True], ids=["qwen3", "gemma3"])
def test_per_head_norm_on_fused_qkv_views(dtype, gemma):
    # Qwen3 / Gemma 3 q/k norms: [T, heads, head_dim] views of q inside qkv (row stride = q + 2 kv).
    t, nq, nkv, hd = 3, 4, 2, 16
    qkv = _randn(t, (nq + 2 * nkv) * hd, dtype=dtype, seed=5).to(DEVICE)
    q, k, _ = qkv.split([nq * hd, nkv * hd, nkv * hd], dim=-1)
    layer = _rms_layer(hd, dtype, gemma, seed=6)
    for part, heads in ((q, nq), (k, nkv)):
        view = part.reshape(t, heads, hd)
        assert not view.is_contiguous()
        got = rms_norm(view, layer.weight, layer.eps, gemma)
        assert got.shape == (t, heads, hd)
        _close(got, layer.forward_torch(view))


def test_fused_add_rms_norm_mixed_layouts():
    """x a per-head view and residual contiguous (or the reverse): both read at their own addresses."""
    t, heads, hd = 3, 4, 16
    layer = _rms_layer(hd, torch.float32, False, seed=10)
    wide = _randn(t, heads * hd + 8, dtype=torch.float32, seed=11).to(DEVICE)
    view = wide[:, : heads * hd].view(t, heads, hd)  # rows split as (t, heads): strided
    # [t, heads, hd] with a strided last dim: copied to contiguous rows, split as (t * heads, 1).
    cols = (_randn(t, hd, heads, dtype=torch.float32, seed=12) * 4).to(DEVICE).transpose(1, 2)
    for x, residual in ((view, cols), (cols, view), (view, cols.contiguous())):
        normed, new_residual = fused_add_rms_norm(x, residual, layer.weight, layer.eps)
        want_normed, want_residual = layer.forward_torch(x, residual)
        assert torch.equal(new_residual, want_residual)
        _close(normed, want_normed)


def test_rms_norm_odd_layouts_and_empty():
    layer = _rms_layer(32, torch.float16, False, seed=7)
    x4 = _randn(2, 2, 3, 32, dtype=torch.float16, seed=8).to(DEVICE)
    _close(rms_norm(x4, layer.weight, layer.eps), layer.forward_torch(x4))  # contiguous 4-D: flattened rows
    xt = _randn(32, 4, dtype=torch.float16, seed=9).to(DEVICE).t()  # last dim not contiguous: copied
    _close(rms_norm(xt, layer.weight, layer.eps), layer.forward_torch(xt))
    empty = torch.empty(0, 32, dtype=torch.float16, device=DEVICE)
    assert rms_norm(empty, layer.weight, layer.eps).shape == (0, 32)


def test_rms_norm_rejects_mismatches():
    w = torch.ones(16, device=DEVICE)
    with pytest.raises(ValueError, match="weight in"):
        rms_norm(torch.ones(2, 16, dtype=torch.float16, device=DEVICE), w, 1e-6)  # Llama: fp32 weight, fp16 x
    with pytest.raises(ValueError, match="one shape and dtype"):
        fused_add_rms_norm(torch.ones(2, 16, device=DEVICE), torch.ones(3, 16, device=DEVICE), w, 1e-6)


# --- rotary ------------------------------------------------------------------------------------


def _rope(head_size: int, rotary_dim: int, neox: bool) -> RotaryEmbedding:
    params = {"rope_theta": 10000.0, "rope_type": "default"}
    return RotaryEmbedding(head_size, rotary_dim, 64, params, is_neox_style=neox).to(DEVICE)


ROPE_CASES = [  # (head_size, rotary_dim, neox)
    (16, 16, True), (16, 16, False),  # full rotation, both styles
    (24, 24, True),  # half rotary dim 12: padded lanes
    (32, 16, True), (32, 8, False),  # partial rotary: tail copied
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("head_size,rotary_dim,neox", ROPE_CASES)
def test_rotary_on_fused_qkv_views_is_bit_exact(dtype, head_size, rotary_dim, neox):
    t, nq, nkv = 5, 3, 1  # one kv head (MQA): an int arg of 1 is specialised by Triton
    rope = _rope(head_size, rotary_dim, neox)
    qkv = (_randn(t, (nq + 2 * nkv) * head_size, dtype=dtype, seed=head_size + rotary_dim) * 2).to(DEVICE)
    q, k, _ = qkv.split([nq * head_size, nkv * head_size, nkv * head_size], dim=-1)
    positions = torch.tensor([0, 63, 7, 7, 31], device=DEVICE)
    qkv_before = qkv.clone()
    got_q, got_k = rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, head_size, rotary_dim, neox)
    want_q, want_k = rope.forward_torch(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_q.shape == q.shape and got_k.shape == k.shape
    assert torch.equal(qkv, qkv_before), "inputs were modified"


def test_rotary_three_dim_inputs_and_empty():
    rope = _rope(16, 16, True)
    q = _randn(4, 2, 16, dtype=torch.bfloat16, seed=10).to(DEVICE)
    k = _randn(4, 2, 16, dtype=torch.bfloat16, seed=11).to(DEVICE)
    positions = torch.tensor([3, 1, 4, 1], dtype=torch.int32, device=DEVICE)
    got = rotary_embedding(positions, q, k, rope.cos_cache, rope.sin_cache, 16, 16, True)
    want = rope.forward_torch(positions.long(), q, k)
    assert got[0].shape == q.shape and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    empty = torch.empty(0, 32, dtype=torch.bfloat16, device=DEVICE)
    out = rotary_embedding(torch.empty(0, dtype=torch.int64, device=DEVICE), empty, empty, rope.cos_cache,
                           rope.sin_cache, 16, 16, True)
    assert out[0].shape == (0, 32)


# --- gated activations -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu_none"])
def test_act_and_mul(dtype, act):
    d = 40
    # Rows of a wider buffer (strided), plus a 3-D input.
    x = (_randn(6, 2 * d + 8, dtype=dtype, seed=12) * 2).to(DEVICE)[:, : 2 * d]
    x3 = (_randn(2, 3, 2 * d, dtype=dtype, seed=13) * 2).to(DEVICE)
    if act == "silu":
        layer, fused = SiluAndMul(), silu_and_mul
    else:
        approximate = act.removeprefix("gelu_")
        layer = GeluAndMul(approximate)

        def fused(v):
            return gelu_and_mul(v, approximate)

    for inp in (x, x3):
        want = layer.forward_torch(inp)
        if act == "silu":
            _close(fused(inp), want)
        else:
            # GELU of a negative gate is 0.5 g (1 + t) with t near -1: tanh/erf implementations an ulp
            # of 1 apart (the interpreter's tanh is 1 - 2 / (exp(2x) + 1), PyTorch's CPU kernels use
            # Sleef) give an error of about an ulp of |g * up|, far above an ulp of the small result
            # (a few % of 16-bit outputs differ): bound it absolutely. On CUDA both use libdevice-grade
            # tanhf/erff (tests/gpu/test_fused_elementwise_cuda.py is stricter).
            _close(fused(inp), want, abs_scale=want.abs().max().item(), min_exact=0.8)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_swiglu_oai_matches_the_torch_formula(dtype):
    """gpt-oss's clamped SwiGLU (the fused MoE's "swigluoai"): gates and ups spread past the +-7 limit."""
    d = 40
    x = (_randn(6, 2 * d + 8, dtype=dtype, seed=14) * 6).to(DEVICE)[:, : 2 * d]
    x3 = (_randn(2, 3, 2 * d, dtype=dtype, seed=15) * 6).to(DEVICE)
    for inp in (x, x3):
        assert (inp[..., :d].float() > SWIGLU_OAI_LIMIT).any() and (inp[..., d:].float() < -SWIGLU_OAI_LIMIT).any()
        want = act_and_mul(inp, "swigluoai")
        # sigmoid's exp: NumPy's in the interpreter, Sleef's in PyTorch's CPU kernel (an ulp apart), so a
        # rounding may flip; bound absolutely by the largest output, as for GELU.
        _close(swiglu_oai_and_mul(inp, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT), want,
               abs_scale=want.abs().max().item(), min_exact=0.9)


def test_expert_activation_takes_the_fused_swiglu_oai(monkeypatch):
    from tokenmill.kernels.triton import activation, fused_moe

    calls = []
    monkeypatch.setattr(activation, "swiglu_oai_and_mul", lambda x, a, l: calls.append((a, l)) or x[..., : x.shape[-1] // 2])
    monkeypatch.setattr(kernels, "use_fused_kernels", lambda t: True)
    fused_moe.expert_activation(torch.ones(3, 8), "swigluoai")
    assert calls == [(SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)]


def test_act_and_mul_rejects_bad_inputs():
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.ones(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="approximate"):
        gelu_and_mul(torch.ones(2, 4, device=DEVICE), "sigmoid")


# --- layer dispatch ----------------------------------------------------------------------------


def test_cpu_tensors_keep_the_torch_path():
    assert not use_fused_kernels(torch.ones(2))


def test_disable_env(monkeypatch):
    _fused_kernels_available.cache_clear()
    monkeypatch.setenv("TOKENMILL_DISABLE_FUSED_KERNELS", "1")
    try:
        assert not _fused_kernels_available()
    finally:
        _fused_kernels_available.cache_clear()
    monkeypatch.delenv("TOKENMILL_DISABLE_FUSED_KERNELS")
    assert _fused_kernels_available()
    _fused_kernels_available.cache_clear()


def test_layers_dispatch_to_the_kernels(monkeypatch):
    """Force the CUDA branch on CPU tensors (interpreter): the layers' wiring of the kernels is right."""
    monkeypatch.setattr(kernels, "use_fused_kernels", lambda x: True)
    dtype = torch.bfloat16
    norm = _rms_layer(32, dtype, False, seed=14)
    x = _randn(3, 32, dtype=dtype, seed=15).to(DEVICE)
    res = _randn(3, 32, dtype=dtype, seed=16).to(DEVICE)
    _close(norm(x), norm.forward_torch(x))
    got, want = norm(x, res), norm.forward_torch(x, res)
    assert torch.equal(got[1], want[1])
    _close(got[0], want[0])

    rope = _rope(16, 8, False)
    q, k = _randn(3, 32, dtype=dtype, seed=17).to(DEVICE), _randn(3, 16, dtype=dtype, seed=18).to(DEVICE)
    pos = torch.tensor([1, 2, 3], device=DEVICE)
    for a, b in zip(rope(pos, q, k), rope.forward_torch(pos, q, k), strict=True):
        assert torch.equal(a, b)

    g = _randn(3, 16, dtype=dtype, seed=19).to(DEVICE)
    _close(SiluAndMul()(g), SiluAndMul().forward_torch(g))
    _close(GeluAndMul("tanh")(g), GeluAndMul("tanh").forward_torch(g))
    # Unsupported inputs fall back to PyTorch (float64 has no fused kernel).
    g64 = g.double()
    assert torch.equal(SiluAndMul()(g64), SiluAndMul().forward_torch(g64))
