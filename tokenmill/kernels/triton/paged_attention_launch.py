"""Host launcher of the paged-attention kernel (`paged_attention.paged_attention_kernel`).

Checks the arguments, picks the tiles and split count (`attention_config`, host
ints only), allocates the split-KV buffers, launches the kernel once (or twice
in a mixed step: the decode and prefill roles) and merges the splits
(`merge_splits`). The work split, roles and block numbering are described in
`paged_attention.py`'s module docstring.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.kv_fp8 import kv_fp8_code
from tokenmill.kernels.triton.attention_config import (
    AttentionLaunchConfig,
    choose_decode_launch_config,
    choose_launch_config,
    choose_num_splits,
)
from tokenmill.kernels.triton.kv_fp8 import decode_unit, kv_cache_arg
from tokenmill.kernels.triton.merge_splits import merge_splits
from tokenmill.kernels.triton.paged_attention import paged_attention_kernel
from tokenmill.kernels.triton.splitk import device_facts


# fp8 caches on cc >= 8.9 decode with the conversion instructions (the kernel's KV_NATIVE); False keeps the bit
# decode everywhere (A/B timing: benchmarks/gpu/sweep_tiles.py --fp8).
FP8_NATIVE = True


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_reqs: int,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    num_stages: int = 2,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    heavy_first: bool = True,
    split_decodes: bool = True,
) -> torch.Tensor:
    """Causal attention of each new token over its request's paged K/V.

    Args:
        query: [num_tokens, num_heads, head_dim] fp16/bf16/fp32, last dim
            contiguous. Tokens past `query_start_loc[num_reqs]` are padding
            (their output rows are set to 0).
        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim], same
            dtype as `query` or float8_e4m3fn / float8_e5m2 (read as q8 * k_scale,
            q8 * v_scale), already holding this step's new keys/values.
        block_table: [>= num_reqs, max_blocks_per_req] int32 block ids.
        seq_lens: [>= num_reqs] int32, context + new tokens per request.
        query_start_loc: [num_reqs + 1] int32 prefix sum of new-token counts.
        num_reqs, max_query_len: host ints (no device sync is made).
        scale: softmax scale, usually head_dim ** -0.5.
        sliding_window: if set, position p sees keys in (p - window, p].
        logits_soft_cap: if set, scores become cap * tanh(scale * qk / cap)
            (Gemma 2, arXiv:2408.00118).
        out: optional [num_tokens, num_heads, head_dim] output buffer.
        num_stages: software-pipelining depth (use 1 on compute capability 7.x).
        block_m, block_n, num_warps: overrides of `choose_launch_config` (tests, tuning); of them only
            block_n also applies to a mixed step's decode launch.
        max_seq_len: host int, the longest seq_len (caps the split count).
        num_splits: split each KV range over this many programs and merge
            (flash-decoding); default from `choose_num_splits`. Any value is
            correct for any data, so a CUDA graph may keep the captured one.
        sinks: [num_heads] per-head sink logits (any float dtype; gpt-oss):
            each softmax denominator gains exp(sinks[h]); None = off.
        k_scale, v_scale: the layer's fp8 KV scales (host floats); ignored by a 16/32-bit cache.
        heavy_first: launch each request's query blocks last to first (module docstring); False keeps
            request order (same result; for timing).
        split_decodes: in a mixed step (max_query_len > 4), run the requests of 1..BLOCK_Q_dec new tokens
            (the decode tiles' tokens: 4 with 4 query heads per kv head) in a launch of their own with the
            decode-step tiles (`choose_decode_launch_config`; module docstring, "Mixed steps"); False = one
            launch with the prefill tiles (same result up to float rounding; for A/B timing).

    Returns:
        out: [num_tokens, num_heads, head_dim], dtype of `query`. Every
        element is written.

    Raises:
        ValueError: num_heads is not a multiple of num_kv_heads.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
    assert kv_cache.shape[4] == head_dim and query.stride(2) == 1 and kv_cache.stride(4) == 1
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},), one logit per query head; got "
                             f"{tuple(sinks.shape)}.")
        sinks = sinks.float().contiguous()
    qpk = num_heads // num_kv_heads
    cap = device_facts(query.device)[0] if query.is_cuda else None
    cfg = choose_launch_config(
        max_query_len, qpk, head_dim, num_stages=num_stages, block_m=block_m, block_n=block_n, num_warps=num_warps,
        large_tiles=cap is not None and cap >= (9, 0) and query.element_size() == 2,
        small_shared=cap == (7, 5),
    )
    if num_splits is None:
        num_splits = choose_num_splits(query.device, max_query_len, num_reqs, num_kv_heads, max_seq_len)
    split_kv = num_splits > 1
    if split_kv:
        partial = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device)
        dst = partial
        dst_split_stride, dst_tok_stride, dst_head_stride = partial.stride(0), partial.stride(1), partial.stride(2)
        lse_split_stride, lse_tok_stride = lse.stride(0), lse.stride(1)
    else:
        dst, lse = out, out  # lse_ptr unused when SPLIT_KV is off
        dst_split_stride, dst_tok_stride, dst_head_stride = 0, out.stride(0), out.stride(1)
        lse_split_stride, lse_tok_stride = 0, 0
    fp8 = kv_fp8_code(kv_cache.dtype)
    native = bool(fp8) and FP8_NATIVE and cap is not None and cap >= (8, 9)
    unit = decode_unit(kv_cache.dtype, native) if fp8 else 1.0
    dec_cfg = None
    if split_decodes:
        dec_cfg = choose_decode_launch_config(max_query_len, cfg, qpk, head_dim, num_stages=num_stages,
                                              block_n=block_n)

    def launch(tiles: AttentionLaunchConfig, role: int, num_q_blocks: int, heavy_first: bool) -> None:
        paged_attention_kernel[(num_q_blocks * num_kv_heads, num_splits)](
            dst,
            lse,
            query,
            kv_cache_arg(kv_cache),
            block_table,
            seq_lens,
            query_start_loc,
            sinks if sinks is not None else query,
            float(scale) * (float(k_scale) * unit if fp8 else 1.0),
            float(v_scale) * unit if fp8 else 1.0,
            float(logits_soft_cap or 0.0),
            int(sliding_window or 0),
            num_reqs,
            num_tokens,
            query.stride(0),
            query.stride(1),
            dst_split_stride,
            dst_tok_stride,
            dst_head_stride,
            lse_split_stride,
            lse_tok_stride,
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            block_table.stride(0),
            qpk,
            head_dim,
            num_kv_heads,
            num_q_blocks,
            BLOCK_SIZE=block_size,
            BLOCK_Q=tiles.block_q,
            QPK_PAD=tiles.qpk_pad,
            BLOCK_M=tiles.block_m,
            BLOCK_N=tiles.block_n,
            HEAD_DIM_PAD=tiles.head_dim_pad,
            USE_WINDOW=sliding_window is not None and sliding_window > 0,
            USE_SOFTCAP=logits_soft_cap is not None and logits_soft_cap > 0,
            USE_SINKS=sinks is not None,
            DOT_PREC="ieee" if query.dtype == torch.float32 else "tf32",
            NUM_SPLITS=num_splits,
            SPLIT_KV=split_kv,
            KV_FP8=fp8,
            KV_NATIVE=native,
            Q_F16=bool(fp8) and query.dtype == torch.bfloat16,
            HEAVY_FIRST=heavy_first,
            ROLE=role,
            DECODE_Q=dec_cfg.block_q if role == 2 else 0,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )

    # Grids from host ints only (a CUDA graph replays both launches of a mixed step).
    if dec_cfg is None:
        launch(cfg, 0, num_tokens // cfg.block_q + num_reqs + 1, heavy_first)
    else:
        if num_reqs > 0:
            launch(dec_cfg, 1, num_reqs, False)  # one program per (request, kv head)
        launch(cfg, 2, num_tokens // cfg.block_q + num_reqs + 1, heavy_first)
    if split_kv:
        merge_splits(partial, lse, out, sinks)
    return out
