"""Triton kernel: merge split-KV (flash-decoding) partial attention results.

When a decode step has too few (request, kv head) pairs to fill the GPU,
`paged_attention` splits each KV range into `num_splits` pieces on a third
grid axis (Dao et al., "Flash-Decoding for long-context inference", 2023).
Split s leaves its normalized partial output o_s and lse_s = log2(sum_j 2^{s_j})
(scores in base 2); the exact result is

    out = sum_s 2^{lse_s - M} o_s / sum_s 2^{lse_s - M},   M = max_s lse_s

An empty split has lse = -inf and weight 0; a row whose every split is empty
(padding) gets 0. Attention sinks (gpt-oss) enter as one more split with
lse = sink * log2(e) and o = 0: they add to the denominator only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_ptr,  # fp32 [num_splits, num_tokens, num_heads, head_dim]
    lse_ptr,  # fp32 [num_splits, num_tokens, num_heads]
    sinks_ptr,  # fp32 [num_heads], read when USE_SINKS
    num_splits,
    stride_p_split,
    stride_p_tok,
    stride_p_head,
    stride_lse_split,
    stride_lse_tok,
    stride_o_tok,
    stride_o_head,
    head_dim,
    SPLITS_PAD: tl.constexpr,  # next power of two >= num_splits
    HEAD_DIM_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_valid = s < num_splits
    d_valid = d < head_dim
    lse = tl.load(lse_ptr + s * stride_lse_split + tok * stride_lse_tok + head, mask=s_valid, other=float("-inf"))
    m = tl.max(lse, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        # A padding row (every split empty) keeps output 0 whatever its sink.
        m = tl.where(m == float("-inf"), m, tl.maximum(m, sink))
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for empty splits
    total = tl.sum(w, 0)
    if USE_SINKS:
        total += tl.where(m == float("-inf"), 0.0, tl.exp2(sink - m))
    o = tl.load(
        partial_ptr + s[:, None] * stride_p_split + tok * stride_p_tok + head * stride_p_head + d[None, :],
        mask=s_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    res = tl.sum(o * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + d, res.to(out_ptr.dtype.element_ty), mask=d_valid)


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Combine per-split results into `out` (in place; returned).

    Args:
        partial: fp32 [num_splits, num_tokens, num_heads, head_dim], each split's
            normalized output (0 for empty splits).
        lse: fp32 [num_splits, num_tokens, num_heads], base-2 log-sum-exp of
            each split's scores (-inf for empty splits).
        out: [num_tokens, num_heads, head_dim], any float dtype, last dim contiguous.
        sinks: fp32 [num_heads] per-head sink logits (natural-log units, as the
            scaled scores), or None.
    """
    num_splits, num_tokens, num_heads, head_dim = partial.shape
    assert lse.shape == (num_splits, num_tokens, num_heads) and lse.stride(2) == 1 and partial.stride(3) == 1
    if num_tokens == 0:
        return out
    merge_splits_kernel[(num_tokens, num_heads)](
        out,
        partial,
        lse,
        sinks if sinks is not None else lse,
        num_splits,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        head_dim,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        USE_SINKS=sinks is not None,
        num_warps=4,
    )
    return out
