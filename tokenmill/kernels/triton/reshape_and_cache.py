"""Triton kernel: write a step's new keys/values into the paged KV cache.

Cache layout (see docs/architecture.md, "KV cache"):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]
              [0] = keys, [1] = values
    slot s  -> block s // block_size, offset s % block_size

One program per token copies that token's [num_kv_heads, head_dim] key and
value tiles. Padding tokens carry slot -1 and are skipped (their stores are
masked off), so a CUDA graph captured at a padded batch size never writes
garbage into a real block.

An fp8 cache (float8_e4m3fn / float8_e5m2) is written as its uint8 bits:
each key is divided by the layer's k_scale and rounded to fp8 (values by
v_scale), the rule of `kernels/kv_fp8.py`, by `triton/kv_fp8.encode_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.kv_fp8 import kv_fp8_code
from tokenmill.kernels.triton.kv_fp8 import encode_kv, kv_cache_arg


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    k_scale,  # fp32, used when KV_FP8
    v_scale,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_kv,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= num_kv_heads
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= head_dim
    KV_FP8: tl.constexpr,  # 0: cache in a float dtype; 1 / 2: uint8 bits of e4m3fn / e5m2 (triton/kv_fp8.py)
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    # slot -1 (padding) -> every store below is masked off.
    valid = slot >= 0
    block_id = tl.where(valid, slot // BLOCK_SIZE, 0)
    block_off = tl.where(valid, slot % BLOCK_SIZE, 0)

    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim) & valid

    k = tl.load(key_ptr + tok * stride_k_tok + h * stride_k_head + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_v_tok + h * stride_v_head + d, mask=mask)
    dst = block_id * stride_c_block + block_off * stride_c_slot + h * stride_c_head + d
    k = encode_kv(k, k_scale, KV_FP8)
    v = encode_kv(v, v_scale, KV_FP8)
    tl.store(kv_cache_ptr + dst, k.to(kv_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(kv_cache_ptr + stride_c_kv + dst, v.to(kv_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write `key`/`value` into `kv_cache` at `slot_mapping` (in place).

    Args:
        key: [num_tokens, num_kv_heads, head_dim], last dim contiguous.
        value: same shape as `key`, last dim contiguous.
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], last dim
            contiguous; same dtype as key/value (or one they cast to), or
            float8_e4m3fn / float8_e5m2 (stored as key / k_scale, value / v_scale,
            rounded to nearest even and saturating: `kernels/kv_fp8.quantize_kv`).
        slot_mapping: [num_tokens] int64 (or int32); -1 marks a padding token
            whose key/value are not written.
        k_scale, v_scale: the layer's fp8 KV scales (host floats); ignored by a 16/32-bit cache.

    No host sync; the launch grid depends only on `num_tokens`. CPU tensors
    run under the Triton interpreter (TRITON_INTERPRET=1 must be set before
    triton is imported).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value shapes differ"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, blocks, block_size, heads, dim]"
    assert kv_cache.shape[3] == num_kv_heads and kv_cache.shape[4] == head_dim
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    if num_tokens == 0:
        return
    block_size = kv_cache.shape[2]
    reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        kv_cache_arg(kv_cache),
        slot_mapping,
        float(k_scale),
        float(v_scale),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        KV_FP8=kv_fp8_code(kv_cache.dtype),
        num_warps=4,
    )
