"""Triton kernel: gated activations act(x[..., :d]) * x[..., d:] in one launch.

Matches tokenmill/layers/activation.py's `F.silu(gate) * up` and
`F.gelu(gate, approximate) * up`: the activation is evaluated in float32
with PyTorch's CUDA formulas (aten/src/ATen/native/cuda/ActivationSiluKernel.cu,
ActivationGeluKernel.cu), rounded to the dtype D, then multiplied by `up`
and rounded again:

    silu:       g / (1 + exp(-g))                               (IEEE division)
    gelu tanh:  0.5 g (1 + tanh(k_beta * fma(k_kappa, g^3, g)))  k_beta = sqrt(2/pi), k_kappa = 0.044715
    gelu erf:   0.5 g (1 + erf(g / sqrt(2)))                     (g * M_SQRT1_2)
    out = round_D(round_D(act(g)) * up)

and gpt-oss's clamped SwiGLU ("swigluoai", `kernels/moe_activation.py`), rounded after every step as
PyTorch's eager ops there round (each op computes in float32 and stores D; sigmoid as PyTorch's CUDA
kernel, 1 / (1 + exp(-x)) with IEEE division):

    g = min(g, limit);  u = clamp(up, -limit, limit)
    out = round_D(round_D(u + 1) * round_D(g * round_D(sigmoid(round_D(g * alpha)))))

The fma is where nvcc contracts PyTorch's `x + kKappa * x_cube`; exp, tanh
and erf are libdevice's, as PyTorch's kernels call. Under Triton's
interpreter (CPU tests) exp/tanh/erf come from NumPy/math, so results
there match PyTorch's CPU kernels only to about one float32 ulp before
rounding.

Grid: (rows, column blocks of BLOCK_D); x is [rows, 2d] with a row stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.numerics import FUSED_DTYPES, exp_f32, round_code, round_to, tanh_f32, use_libdevice

ACT_SILU = 0
ACT_GELU_TANH = 1
ACT_GELU_ERF = 2
ACT_SWIGLU_OAI = 3

_MAX_BLOCK_D = 1024


@triton.jit
def act_and_mul_kernel(
    x_ptr,  # [rows, 2 * d], row stride stride_x: [gate | up]
    out_ptr,  # [rows, d] contiguous
    d,
    stride_x,
    ACT: tl.constexpr,  # ACT_SILU / ACT_GELU_TANH / ACT_GELU_ERF / ACT_SWIGLU_OAI
    ROUND: tl.constexpr,  # activation dtype: see numerics.round_to
    USE_LIBDEVICE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALPHA: tl.constexpr = 1.702,  # ACT_SWIGLU_OAI only
    LIMIT: tl.constexpr = 7.0,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = tl.math.div_rn(g, 1.0 + exp_f32(-g, USE_LIBDEVICE))
    elif ACT == 1:
        kappa = tl.full([BLOCK_D], 0.044715, tl.float32)
        inner = 0.7978845608028654 * tl.fma(kappa, g * g * g, g)
        a = 0.5 * g * (1.0 + tanh_f32(inner, USE_LIBDEVICE))
    elif ACT == 2:
        a = g * 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
    if ACT == 3:
        g = tl.where(g > LIMIT, LIMIT, g)  # NaN stays NaN, as torch.clamp
        up = tl.where(up > LIMIT, LIMIT, tl.where(up < -LIMIT, -LIMIT, up))
        z = round_to(g * ALPHA, ROUND)
        sig = round_to(tl.math.div_rn(1.0, 1.0 + exp_f32(-z, USE_LIBDEVICE)), ROUND)
        out = round_to(round_to(up + 1.0, ROUND) * round_to(g * sig, ROUND), ROUND)
    else:
        out = round_to(round_to(a, ROUND) * up, ROUND)
    tl.store(out_ptr + row * d + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(x[..., :d]) * x[..., d:] in one launch.

    Args:
        x: [..., 2d] float32/float16/bfloat16 (rows may be strided; the last
            dim must be contiguous or x is copied first).

    Returns:
        [..., d] contiguous, x's dtype.

    Raises:
        ValueError: an unsupported dtype or an odd last dim.
    """
    return _launch(x, ACT_SILU)


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """GeGLU: gelu(x[..., :d], approximate) * x[..., d:] in one launch.

    Args:
        x: as in `silu_and_mul`.
        approximate: "tanh" (gelu_pytorch_tanh) or "none" (erf).

    Returns:
        [..., d] contiguous, x's dtype.

    Raises:
        ValueError: an unsupported dtype, an odd last dim, or another `approximate`.
    """
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu_and_mul approximate must be 'tanh' or 'none', got {approximate!r}.")
    return _launch(x, ACT_GELU_TANH if approximate == "tanh" else ACT_GELU_ERF)


def swiglu_oai_and_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of `[gate | up]` rows in one launch (module docstring; the PyTorch form is
    `kernels.moe_activation.act_and_mul(x, "swigluoai")`, bit-equal on CUDA).

    Args:
        x: as in `silu_and_mul`.
        alpha, limit: the config's swiglu_alpha (1.702) and swiglu_limit (7.0); compile-time constants.

    Returns:
        [..., d] contiguous, x's dtype.

    Raises:
        ValueError: an unsupported dtype or an odd last dim.
    """
    return _launch(x, ACT_SWIGLU_OAI, alpha=float(alpha), limit=float(limit))


def _launch(x: torch.Tensor, act: int, **consts: float) -> torch.Tensor:
    if x.dtype not in FUSED_DTYPES:
        raise ValueError(f"Fused gated activations support float32/float16/bfloat16, got {x.dtype}.")
    two_d = x.shape[-1]
    if two_d % 2:
        raise ValueError(f"A gated activation needs an even last dim ([gate | up]), got {two_d}.")
    d = two_d // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, two_d) if x.is_contiguous() else x.contiguous().view(-1, two_d)
    rows = x.shape[0]
    if rows == 0 or d == 0:
        return out
    block_d = min(_MAX_BLOCK_D, triton.next_power_of_2(d))
    act_and_mul_kernel[(rows, triton.cdiv(d, block_d))](
        x,
        out,
        d,
        x.stride(0),
        ACT=act,
        ROUND=round_code(x.dtype),
        USE_LIBDEVICE=use_libdevice(x),
        BLOCK_D=block_d,
        **{k.upper(): v for k, v in consts.items()},
        num_warps=4,
        enable_fp_fusion=False,  # only the explicit fma, as nvcc contracts PyTorch's gelu
    )
    return out
