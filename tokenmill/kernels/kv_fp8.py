"""The fp8 KV cache in plain PyTorch: how K/V are stored and read back (`--kv-cache-dtype fp8*`).

One scale per layer for keys and one for values (vLLM's `k_scale` / `v_scale`; 1.0 when the
checkpoint has none). A token's key k (any float dtype) is stored as

    q = fp8_rne(clamp(k / k_scale, -MAX, MAX))      MAX = 448 (e4m3fn) or 57344 (e5m2)

(float32 division, round to nearest even, saturating; OCP 8-bit Floating Point Specification
(OFP8) rev. 1.0, 2023) and read as q * k_scale; values likewise with v_scale. The Triton kernels
(`kernels/triton/kv_fp8.py`) write the same bits and fold the scales into the softmax scale and the
output (scores = (q . q8_k) * (softmax_scale * k_scale), out = (p @ q8_v) * v_scale / l), which
equals attending over the dequantized cache up to float rounding. These functions are the reference
and the CPU / TORCH_SDPA path; they need no FP8 arithmetic (torch converts fp8 in software on CPU and
every CUDA capability).
"""

from __future__ import annotations

import torch

from tokenmill.dtypes import FP8_MAX, is_fp8



# The kernels' code for a KV cache's storage (the Triton kernels' KV_FP8 constexpr, the C kernel's KV_FMT):
# 0 = the cache is in the query's dtype, 1 = e4m3fn codes, 2 = e5m2 codes.
_KV_FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def kv_fp8_code(dtype: torch.dtype) -> int:
    """The kernels' code of a KV cache of `dtype`: 0 (16/32-bit), 1 (e4m3fn) or 2 (e5m2)."""
    return _KV_FP8_CODES.get(dtype, 0)


def kv_unit(dtype: torch.dtype) -> float:
    """What the kernels' decoded KV values are to be multiplied by: 256 for e4m3 (the integer decode yields
    value / 256, `kernels/triton/fp8_quant.e4m3_to_f16_div256` and decode_attention.c), else 1."""
    return 256.0 if dtype == torch.float8_e4m3fn else 1.0

def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to the fp8 `dtype` (saturating), any shape -> same shape in `dtype`.

    Raises:
        ValueError: `dtype` is not float8_e4m3fn or float8_e5m2.
    """
    if not is_fp8(dtype):
        raise ValueError(f"quantize_kv stores float8_e4m3fn or float8_e5m2, not {dtype}.")
    limit = FP8_MAX[dtype]
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def dequantize_kv(q: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in `dtype` (product in float32, rounded once); q is an fp8 tensor of any shape."""
    return (q.float() * scale).to(dtype)


def store_kv(x: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, scale: float) -> None:
    """Write rows x [T, Hkv, D] into the flat cache [num_slots, Hkv, D] at `slots` [T] int64 (all >= 0).

    An fp8 cache gets `quantize_kv(x, scale)` (copied through uint8 views: torch has no fp8 index_copy
    on CPU); a 16/32-bit cache gets x cast to its dtype and ignores `scale`.
    """
    if is_fp8(cache.dtype):
        cache.view(torch.uint8).index_copy_(0, slots, quantize_kv(x, scale, cache.dtype).view(torch.uint8))
    else:
        cache.index_copy_(0, slots, x.to(cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, ...] rows `block_ids` [n] int64 -> [n, ...] in cache's dtype; an fp8 cache is gathered
    through its uint8 bits (not every device has an fp8 index_select)."""
    if is_fp8(cache.dtype):
        return cache.view(torch.uint8).index_select(0, block_ids).view(cache.dtype)
    return cache.index_select(0, block_ids)
