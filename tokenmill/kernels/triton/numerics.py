"""Triton helpers that make fused kernels round like a chain of PyTorch ops.

PyTorch evaluates each elementwise op on float16/bfloat16 tensors in float32
("opmath") and rounds the result to the tensor's dtype, round to nearest
even. A fused kernel that keeps the whole chain in float32 differs in the
last bit; these helpers let a kernel round exactly where the reference does:

    torch:  t = a * b          (bf16)     kernel: t = round_to(a * b, ROUND)
            y = t - c * d      (bf16)             y = round_to(t - round_to(c * d, ROUND), ROUND)

`ROUND` codes (from `round_code(dtype)`): 0 float32 (no rounding),
1 float16, 2 bfloat16. Values stay float32 in registers, holding numbers
exactly representable in the target dtype, so storing them to a
float16/bfloat16 pointer is exact.

bfloat16 rounds with integer bit operations rather than a float cast:
Triton 3.6's interpreter (the CPU tests) truncates float32 -> bfloat16
casts instead of rounding, and one code path on both keeps the CPU tests
meaningful for the GPU.

Math functions: on a GPU, `exp`/`tanh` use libdevice (`__nv_expf`,
`__nv_tanhf`), the same accurate functions PyTorch's CUDA kernels call,
rather than Triton's faster approximations; the interpreter has no libdevice
(`USE_LIBDEVICE=False`) and uses NumPy's through `tl.exp`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tokenmill import envs

_ROUND_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

FUSED_DTYPES = tuple(_ROUND_CODES)


def round_code(dtype: torch.dtype) -> int:
    """The `ROUND` constexpr for activations of `dtype`.

    Raises:
        ValueError: `dtype` is not float32, float16 or bfloat16.
    """
    code = _ROUND_CODES.get(dtype)
    if code is None:
        raise ValueError(f"Fused kernels support float32, float16 and bfloat16 activations, got {dtype}.")
    return code


def use_libdevice(x: torch.Tensor) -> bool:
    """True when kernels on `x` are compiled for a GPU (not run by Triton's interpreter)."""
    return x.is_cuda and not envs.triton_interpret()


@triton.jit
def round_to(x, ROUND: tl.constexpr):
    """float32 x rounded to nearest even in the dtype of `ROUND`, returned as float32."""
    y = x
    if ROUND == 1:
        y = x.to(tl.float16).to(tl.float32)
    if ROUND == 2:
        # Keep the top 16 bits, adding half an ulp minus one plus the kept lsb first:
        # ties go to the even neighbour and a carry moves into the exponent (overflow -> inf).
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        # NaN: set the quiet bit so a payload in the dropped bits cannot turn it into inf.
        quiet_nan = (bits | 0x400000) >> 16 << 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        y = tl.where(is_nan, quiet_nan, rounded).to(tl.float32, bitcast=True)
    return y


@triton.jit
def exp_f32(x, USE_LIBDEVICE: tl.constexpr):
    """exp of float32 x: libdevice's expf on a GPU (as PyTorch's CUDA kernels), tl.exp otherwise."""
    if USE_LIBDEVICE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def tanh_f32(x, USE_LIBDEVICE: tl.constexpr):
    """tanh of float32 x: libdevice's tanhf on a GPU; 1 - 2 / (exp(2x) + 1) in the interpreter."""
    if USE_LIBDEVICE:
        y = libdevice.tanh(x)
    else:
        y = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    return y
