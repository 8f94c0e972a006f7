"""FP8 (e4m3fn) quantization in plain PyTorch: scales, quantize/dequantize, the reference matmuls.

These are the numerical references of the Triton kernels (`kernels/triton/fp8_gemm.py`,
`kernels/triton/fp8_quant.py`) and the CPU path; they run on any device and never need FP8
arithmetic (fp8 bits are decoded through a 256-entry table, `e4m3_to_float16_table`).

Format (OCP 8-bit Floating Point Specification (OFP8) rev. 1.0, 2023, "E4M3"): sign, 4
exponent bits (bias 7), 3 mantissa bits, no infinities, NaN = S.1111.111 (0x7F / 0xFF),
max +-448 = 1.75 * 2^8, smallest subnormal 2^-9. PyTorch calls it `torch.float8_e4m3fn`.

    normal     (e > 0): (-1)^s * 2^(e - 7) * (1 + m / 8)
    subnormal  (e = 0): (-1)^s * 2^-6 * (m / 8)

Quantization (every scheme): scale = max(amax / 448, MIN_SCALE) over the scaled set,
q = fp8_rne(clamp(x / scale, -448, 448)) (round to nearest even, saturating), x ~= q * scale.
The scaled sets (`W` [N, K] is a linear weight in `nn.Linear`'s orientation, `x` [M, K] activations):

    per-tensor        one scale                               scale []             (fp8 checkpoints, static input_scale)
    per-channel       one per output row n of W               scale [N, 1]         (compressed-tensors "channel")
    per-token         one per row m of x, computed per call   scale [M, 1]         (dynamic activations, W8A8)
    per-token-group   x[m, g*G:(g+1)*G], G = 128              scale [M, ceil(K/G)] (DeepSeek-V3 activations)
    block             W[i*Bn:(i+1)*Bn, j*Bk:(j+1)*Bk]         scale [ceil(N/Bn), ceil(K/Bk)]

Block scales are what DeepSeek-V3 / Qwen3-FP8 checkpoints store as `weight_scale_inv` with
`weight_block_size: [128, 128]`: W = q * weight_scale_inv[n // 128, k // 128] (despite the name it
multiplies); a last block row / column may be ragged (N or K not a multiple of 128). The fine-grained
1x128 activation / 128x128 weight recipe is from DeepSeek-V3 Technical Report (arXiv 2412.19437, §3.3.2).

The reference matmuls dequantize in float32, multiply in float32 and round once to x's dtype.
For W8A8 they first quantize x the way the kernels do (per token, per token-group, or with a
static per-tensor scale), so a kernel differs from its reference only by the float32 summation
order (and the tensor cores' accumulation on a GPU).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tokenmill import dtypes

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = dtypes.FP8_MAX[FP8_DTYPE]  # 448.0, the one table of fp8 limits (tokenmill/dtypes.py)
# Floor of every computed scale: an all-zero row gets a finite scale (its q is 0), and 1e-12 stays far above
# float32's subnormals, so no device that flushes subnormals sees a zero divisor.
MIN_SCALE = 1e-12
BLOCK = 128  # DeepSeek / Qwen-FP8 weight block and activation group size


class Fp8Weight(NamedTuple):
    """One FP8 linear weight as the kernels take it.

    weight: [N, K] torch.float8_e4m3fn (or its uint8 bits). scale: float32, one of `[]`/`[1]`
    (per-tensor), `[N]`/`[N, 1]` (per-channel), `[ceil(N/Bn), ceil(K/Bk)]` (block, with block_size).
    block_size: (Bn, Bk) or None. input_scale: float32 `[]`/`[1]` static activation scale
    (`activation_scheme: static`), or None for dynamic per-token (per-token-group with blocks).
    """

    weight: torch.Tensor
    scale: torch.Tensor
    block_size: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None


def weight_scheme(w: Fp8Weight) -> str:
    """"tensor", "channel" or "block" for `w`.

    Raises:
        ValueError: the weight is not 2-D, or the scale's shape fits no scheme for the weight's shape.
    """
    if w.weight.dim() != 2:
        raise ValueError(f"An FP8 weight must be [N, K], not {tuple(w.weight.shape)}.")
    n, k = w.weight.shape
    if w.block_size is not None:
        bn, bk = w.block_size
        if bn <= 0 or bk <= 0:
            raise ValueError(f"weight_block_size must be positive, not {list(w.block_size)}.")
        want = (-(-n // bn), -(-k // bk))
        if tuple(w.scale.shape) != want:
            raise ValueError(f"Block scales of a [{n}, {k}] weight with blocks {list(w.block_size)} must be "
                             f"{list(want)}, not {list(w.scale.shape)}.")
        return "block"
    if w.scale.numel() == 1 and w.scale.dim() <= 1:
        return "tensor"
    if tuple(w.scale.shape) in ((n,), (n, 1)):
        return "channel"
    raise ValueError(f"The scale of a [{n}, {k}] FP8 weight must be [] or [1] (per-tensor) or [{n}] / [{n}, 1] "
                     f"(per-channel), not {list(w.scale.shape)}.")


# ---------------------------------------------------------------------------------------------------------
# Bits <-> values without FP8 hardware


def _e4m3_table_f32() -> torch.Tensor:
    """float32 [256]: the value of every e4m3fn code, computed from the format's definition (module docstring)."""
    code = torch.arange(256, dtype=torch.int32)
    sign = torch.where(code >= 128, -1.0, 1.0)
    e = (code >> 3) & 0xF
    m = (code & 7).float()
    mag = torch.where(e > 0, torch.ldexp(1.0 + m / 8.0, (e - 7).float()), torch.ldexp(m / 8.0, torch.tensor(-6.0)))
    return torch.where((code & 0x7F) == 0x7F, torch.nan, sign * mag)


@functools.cache
def _table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _e4m3_table_f32().to(dtype).to(device)


def e4m3_to_float16_table() -> torch.Tensor:
    """float16 [256]: the value of e4m3fn code c at index c (NaN at 0x7F and 0xFF); every value is exact in
    float16 (3 mantissa bits, exponents 2^-9..2^8 inside float16's range)."""
    return _table(torch.float16, torch.device("cpu")).clone()


def fp8_bits(q: torch.Tensor) -> torch.Tensor:
    """The uint8 bits of an e4m3fn tensor (a view; uint8 passes through).

    Raises:
        ValueError: q is neither torch.float8_e4m3fn nor uint8.
    """
    if q.dtype == torch.uint8:
        return q
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"Expected torch.float8_e4m3fn weights (or their uint8 bits), not {q.dtype}.")
    return q.view(torch.uint8)


def e4m3_to_float(q: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Decode e4m3fn codes (float8_e4m3fn or uint8 bits, any shape, any device) to `dtype` by table lookup.

    Works where torch has no FP8 kernels (V100, CPU builds): one gather from a 256-entry table.
    dtype float16 / bfloat16 / float32 are exact (NaN codes give NaN).
    """
    bits = fp8_bits(q)
    # int32 indices (4 bytes per element, not int64's 8: this decodes whole weights at load time).
    flat = torch.index_select(_table(dtype, bits.device), 0, bits.reshape(-1).int())
    return flat.reshape(bits.shape)


def float_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float -> e4m3fn, round to nearest even, saturating to +-448 (NaN stays NaN); returns float8_e4m3fn.

    torch's own cast rounds to nearest even; the clamp first makes the result the same whether a torch
    version saturates or turns out-of-range values into NaN.
    """
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


# ---------------------------------------------------------------------------------------------------------
# Quantization


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # Divided by a tensor, not a Python number: PyTorch's CUDA division by a scalar multiplies by its
    # float32 reciprocal (1/448 is inexact), which differs from true division in the last bit for about
    # half of all inputs; the CPU and the Triton kernel (tl.div_rn) divide exactly, and all must agree.
    return (amax.float() / torch.full((), FP8_MAX, device=amax.device)).clamp(min=MIN_SCALE)


def quantize_fp8_per_tensor(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape) -> (q float8_e4m3fn like x, scale float32 []); `scale` given = static quantization with it."""
    if scale is None:
        scale = _scale_of(x.abs().amax() if x.numel() else torch.zeros((), device=x.device))
    scale = scale.float().reshape(())
    return float_to_e4m3(x.float() / scale), scale


def quantize_fp8_per_row(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, 1] float32), one scale per row.

    Per-token for activations, per-channel (output row) for a weight [N, K].
    """
    amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else torch.zeros(*x.shape[:-1], 1, device=x.device)
    scale = _scale_of(amax)
    return float_to_e4m3(x.float() / scale), scale


def quantize_fp8_per_group(x: torch.Tensor, group_size: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] float8_e4m3fn, scale [M, ceil(K / G)] float32): one scale per row and run of
    G = group_size along K (the last run may be shorter)."""
    return quantize_fp8_block(x, (1, group_size))


def quantize_fp8_block(w: torch.Tensor, block_size: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q [N, K] float8_e4m3fn, scale [ceil(N/Bn), ceil(K/Bk)] float32), one scale per
    Bn x Bk block (ragged last blocks allowed); w ~= q * scale[n // Bn, k // Bk]."""
    bn, bk = block_size
    n, k = w.shape
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    amax = padded.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    scale = _scale_of(amax)
    q = float_to_e4m3(w.float() / expand_block_scales(scale, (n, k), block_size))
    return q, scale


def expand_block_scales(scale: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N/Bn), ceil(K/Bk)] -> [N, K] with element (n, k) = scale[n // Bn, k // Bk]."""
    n, k = shape
    bn, bk = block_size
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in `dtype` (formed in float32, rounded once), for every scheme of the module docstring.

    Args:
        q: [N, K] float8_e4m3fn or uint8 bits (decoded by table; no FP8 arithmetic needed).
        scale: float32 `[]`/`[1]`, `[N]`/`[N, 1]` (per row), or `[ceil(N/Bn), ceil(K/Bk)]` with block_size.
        block_size: (Bn, Bk) for block / per-token-group scales ((1, 128) for activations), else None.

    Raises:
        ValueError: the scale's shape fits no scheme (`weight_scheme`).
    """
    weight_scheme(Fp8Weight(q, scale, block_size))
    values = e4m3_to_float(q, torch.float32)
    s = scale.float()
    if block_size is not None:
        s = expand_block_scales(s, tuple(q.shape), block_size)
    elif s.numel() == 1:
        s = s.reshape(())
    else:
        s = s.reshape(-1, 1)
    return (values * s).to(dtype)


def dequantize_fp8_weight(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The dense [N, K] weight of `w` in `dtype` (`dequantize_fp8`)."""
    return dequantize_fp8(w.weight, w.scale, w.block_size, dtype)


# ---------------------------------------------------------------------------------------------------------
# Reference matmuls


def quantize_activations_reference(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [M, K] after the W8A8 activation quantization the kernels apply for `w`, dequantized to float32:
    static per-tensor with w.input_scale, else per token-group of Bk for block weights, else per token."""
    if w.input_scale is not None:
        q, s = quantize_fp8_per_tensor(x, w.input_scale)
        return dequantize_fp8(q, s)
    if w.block_size is not None:
        q, s = quantize_fp8_per_group(x, w.block_size[1])
        return dequantize_fp8(q, s, (1, w.block_size[1]))
    q, s = quantize_fp8_per_row(x)
    return dequantize_fp8(q, s)


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    if dtype == torch.float16:  # saturate like the kernels instead of overflowing to inf
        y = y.clamp(-65504.0, 65504.0)
    return y.to(dtype)


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
                         quantize_activations: bool = True) -> torch.Tensor:
    """y = x' @ W^T (+ bias) in float32, rounded to x's dtype; W = dequantize(w).

    x [M, K] float16 / bfloat16 / float32 -> [M, N]. x' = x quantized as W8A8 does
    (`quantize_activations_reference`) when quantize_activations, else x itself (weight-only W8A16).
    """
    xf = quantize_activations_reference(x, w) if quantize_activations else x.float()
    return _finish(xf @ dequantize_fp8_weight(w).t(), bias, x.dtype)
