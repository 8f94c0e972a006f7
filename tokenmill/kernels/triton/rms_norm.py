"""Triton kernels: RMSNorm and fused residual-add + RMSNorm, one launch each.

Same formula and roundings as tokenmill/layers/layernorm.py (HF's
LlamaRMSNorm / GemmaRMSNorm), for activations of dtype D:

    s   = round_D(x + residual)                 (residual variant: new residual, and what is normed)
    r   = rsqrt(sum(s^2) * (1 / N) + eps)       float32
    out = round_D(round_D(s * r) * w)           Llama (w of dtype D)
    out = round_D((s * r) * (1 + w))            Gemma (all float32)

The sum of squares is a tree reduction, not PyTorch's order, so `r` can
differ from the reference in the last float32 bit and `out` then by one
ulp of D in rare elements; the residual sum is bit-exact. `1 / N` is a
float32 multiplier as in PyTorch's CUDA mean kernel.

One program normalises BLOCK_R rows of N elements held in registers
(N <= MAX_HIDDEN_SIZE). Rows are addressed through two strides, so the
per-head views of Qwen3/Gemma 3 q/k norms ([T, heads, head_dim] carved out
of the fused qkv output, rows not contiguous) are read in place:

    row r -> (r // n_inner) * stride_0 + (r % n_inner) * stride_1
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.numerics import FUSED_DTYPES, round_code, round_to

# Largest hidden size kept in one program's registers (Llama 3.1 405B: 16384).
MAX_HIDDEN_SIZE = 16384
# Elements per program (rows * padded hidden size) when rows are short (per-head norms).
_ROW_ELEMENTS = 2048


@triton.jit
def rms_norm_kernel(
    x_ptr,  # [rows, N] through (stride_x0, stride_x1)
    residual_ptr,  # like x (read when HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [rows, N] contiguous
    residual_out_ptr,  # [rows, N] contiguous (written when HAS_RESIDUAL)
    n_rows,
    n_inner,  # rows per outer index (heads of a per-head view; 1 for [T, N])
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    N,
    inv_n,  # float32(1 / N)
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    ROUND: tl.constexpr,  # activation dtype: see numerics.round_to
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    outer = rows // n_inner
    inner = rows % n_inner
    x = tl.load(x_ptr + (outer * stride_x0 + inner * stride_x1)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    dst = rows[:, None] * N + cols[None, :]
    if HAS_RESIDUAL:
        res = tl.load(residual_ptr + (outer * stride_r0 + inner * stride_r1)[:, None] + cols[None, :], mask=mask,
                      other=0.0).to(tl.float32)
        x = round_to(x + res, ROUND)
        tl.store(residual_out_ptr + dst, x, mask=mask)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) * inv_n + eps)
    y = x * rstd[:, None]
    w = tl.load(weight_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if GEMMA:
        y = round_to(y * (1.0 + w), ROUND)
    else:
        y = round_to(round_to(y, ROUND) * w, ROUND)
    tl.store(out_ptr + dst, y, mask=mask)


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor, gemma: bool) -> bool:
    """Whether `rms_norm`/`fused_add_rms_norm` take these inputs (else use the PyTorch path).

    Needs a float32/float16/bfloat16 x, last dim <= MAX_HIDDEN_SIZE and, for
    the Llama variant, weight in x's dtype (PyTorch would promote the product).
    """
    return (x.dtype in FUSED_DTYPES and 0 < x.shape[-1] <= MAX_HIDDEN_SIZE
            and (gemma or weight.dtype == x.dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim in one launch.

    Args:
        x: [..., N] float32/float16/bfloat16; any strides whose last dim is
            contiguous for 2-D/3-D views (other layouts are copied first).
        weight: [N] (x's dtype for the Llama variant; any float for Gemma).
        eps: added to the mean square.
        gemma: scale by `1 + weight` in float32 (GemmaRMSNorm) instead of by weight.

    Returns:
        [..., N] contiguous, x's dtype.

    Raises:
        ValueError: an unsupported dtype or size (see `rms_norm_supported`).
    """
    return _launch(x, None, weight, eps, gemma)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) in one launch; x and residual are not modified.

    Args:
        x, residual: [..., N], same shape and dtype (layouts as in `rms_norm`).
        weight, eps, gemma: as in `rms_norm`.

    Returns:
        (normed [..., N], new_residual [..., N]), both contiguous in x's dtype;
        new_residual = round(x + residual) exactly as `x + residual` in PyTorch.

    Raises:
        ValueError: shapes or dtypes of x and residual differ, or an
            unsupported dtype or size.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"fused_add_rms_norm needs x and residual of one shape and dtype, got "
                         f"{tuple(x.shape)} {x.dtype} and {tuple(residual.shape)} {residual.dtype}.")
    return _launch(x, residual, weight, eps, gemma)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            gemma: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not rms_norm_supported(x, weight, gemma):
        raise ValueError(f"No fused RMSNorm for x {tuple(x.shape)} {x.dtype} with weight {weight.dtype} "
                         f"(needs float32/float16/bfloat16, hidden size <= {MAX_HIDDEN_SIZE}, and weight in "
                         "x's dtype unless gemma).")
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({n},).")
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    x, x_rows = _as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = None
    r_rows = x_rows
    if residual is not None:
        residual, r_rows = _as_rows(residual)
        if r_rows[:2] != x_rows[:2]:  # the kernel addresses both by x's row split: give both one flat layout
            x, x_rows = _as_rows(x.contiguous().view(-1, n))
            residual, r_rows = _as_rows(residual.contiguous().view(-1, n))
        residual_out = torch.empty(out.shape, dtype=x.dtype, device=x.device)
    n_rows, n_inner, sx0, sx1 = x_rows
    if n_rows == 0:
        return out, residual_out
    block_n = triton.next_power_of_2(n)
    block_r = max(1, _ROW_ELEMENTS // block_n)
    rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out if residual_out is not None else out,
        n_rows,
        n_inner,
        sx0,
        sx1,
        r_rows[2],
        r_rows[3],
        n,
        float(np.float32(1.0) / np.float32(n)),  # float32 division, as PyTorch's mean factor
        eps,
        HAS_RESIDUAL=residual is not None,
        GEMMA=gemma,
        ROUND=round_code(x.dtype),
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=min(16, max(1, block_r * block_n // 512)),
        enable_fp_fusion=False,  # no a*b+c contractions: PyTorch rounds each op
    )
    return out, residual_out


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """(x or a contiguous copy, (n_rows, n_inner, stride_0, stride_1)) for the kernel's row addressing.

    [T, N] -> (T, 1, s0, 0); [T, H, N] -> (T * H, H, s0, s1); a 1-D or
    contiguous N-D tensor is its flattened rows; anything else (last dim
    not contiguous, or 4+ strided dims) is copied to contiguous first.
    """
    n = x.shape[-1]
    if x.dim() > 1 and x.stride(-1) == 1:
        if x.dim() == 2:
            return x, (x.shape[0], 1, x.stride(0), 0)
        if x.dim() == 3:
            return x, (x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1))
    x = x.contiguous()
    return x, (x.numel() // n, 1, n, 0)
