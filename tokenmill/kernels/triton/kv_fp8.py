"""fp8 KV-cache encode / decode in Triton, by integer bit operations (any CUDA capability).

The KV cache kernels (`reshape_and_cache.py`, `paged_attention.py`) take the fp8 cache as its uint8
bits and a `KV_FP8` code: 0 = a 16/32-bit cache (no conversion), 1 = float8_e4m3fn, 2 = float8_e5m2.
Bit operations instead of FP8 casts, so the same code compiles for cc 7.0 (no FP8 conversion
instructions below cc 8.9) and runs in Triton's interpreter, whose float -> fp8 casts round wrongly
(`fp8_quant.py`). Formats: OCP OFP8 rev. 1.0 (E4M3: bias 7, max 448; E5M2: bias 15, max 57344,
float16's top byte). Storage rule and scales: `kernels/kv_fp8.py`.

Decoding is exact: e5m2 codes are float16's top byte; e4m3 codes become float16 holding value / 256
(`fp8_quant.e4m3_to_f16_div256`), so the attention kernel multiplies its key scale by `kv_unit(KV_FP8)`
= 256 (and its value scale likewise). Every decoded value (at most 4 significant bits, magnitudes
2^-17 .. 57344) is exact in float16, bfloat16 and float32, so casting it to the query's dtype is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.dtypes import is_fp8
from tokenmill.kernels.kv_fp8 import kv_unit
from tokenmill.kernels.triton.fp8_quant import e4m3_to_f16_div256, f32_to_e4m3_bits

def kv_cache_arg(kv_cache: torch.Tensor) -> torch.Tensor:
    """The tensor a kernel takes for `kv_cache`: the uint8 bits of an fp8 cache (a view), else the cache."""
    return kv_cache.view(torch.uint8) if is_fp8(kv_cache.dtype) else kv_cache


@triton.jit
def f32_to_e5m2_bits(x):
    """float32 x -> e5m2 codes (uint8): round to nearest even, saturating at +-57344, NaN -> 0x7F | sign.

    As `fp8_quant.f32_to_e4m3_bits` with 2 mantissa bits and bias 15: normal results (|x| >= 2^-14)
    round float32's mantissa to 2 bits and rebias (127 - 15 = 112, times 4 for the mantissa bits);
    subnormal results (multiples of 2^-16): 128 + |x| in float32 has an ulp of 2^-16, so the adder rounds
    and the low bits count the steps (0..4; 4 is code 0x04 = 2^-14).
    """
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), 57344.0)
    abits = a.to(tl.uint32, bitcast=True)
    normal = ((abits + 0xFFFFF + ((abits >> 21) & 1)) >> 21) - (112 << 2)
    sub = (a + 128.0).to(tl.uint32, bitcast=True) - 0x43000000  # 0x43000000: bits of 128.0
    code = tl.where(a < 0.00006103515625, sub, normal)  # 2^-14
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def encode_kv(x, scale, KV_FP8: tl.constexpr):
    """x (any float) / scale -> fp8 bits (KV_FP8 1 or 2); KV_FP8 0 returns x unchanged.

    scale: float32; the division is `div_rn` (correctly rounded, as torch's float32 `/`).
    """
    if KV_FP8 == 1:
        y = f32_to_e4m3_bits(tl.div_rn(x.to(tl.float32), scale))
    elif KV_FP8 == 2:
        y = f32_to_e5m2_bits(tl.div_rn(x.to(tl.float32), scale))
    else:
        y = x
    return y


@triton.jit
def decode_kv(bits, KV_FP8: tl.constexpr, NATIVE: tl.constexpr = False):
    """fp8 bits (uint8) -> float16: the value (e5m2) or value / 256 (e4m3, see `kv_unit`); KV_FP8 0: as is.

    NATIVE (compute capability >= 8.9 only, never the interpreter): the hardware's fp8 -> float16 conversion
    (`cvt.rn.f16x2.e4m3x2` / `.e5m2x2`, two values per instruction) instead of the bit operations (about 9
    integer instructions per value for e4m3); it yields the value itself for both formats (unit 1, see
    `decode_unit`). On the H200 the bit decode made a full decode batch's attention 1.9x slower than the
    bfloat16 cache's (issue 21, session 13: 42.6 vs 22.7 ms a step): it is issue-bound there.
    """
    if KV_FP8 == 1:
        if NATIVE:
            y = bits.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            y = e4m3_to_f16_div256(bits)
    elif KV_FP8 == 2:
        if NATIVE:
            y = bits.to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            y = (bits.to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    else:
        y = bits
    return y


def decode_unit(dtype: torch.dtype, native: bool) -> float:
    """What `decode_kv`'s values are to be multiplied by for a cache of `dtype`: 1 for the NATIVE decode,
    else `kernels.kv_fp8.kv_unit` (256 for e4m3's bit decode)."""
    return 1.0 if native else kv_unit(dtype)
