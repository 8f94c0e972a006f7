"""Launch configuration of the paged-attention kernel, from host-side ints only.

Nothing here reads device memory, so a CUDA graph captured for a batch shape
replays the same launch; tile sizes were checked with a sweep on an H200
(benchmarks/gpu/sweep_tiles.py, docs/gpu_notes.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton


# Steps whose longest request adds at most this many tokens are decode steps: 16-row tiles, KV splits allowed.
DECODE_MAX_QUERY_LEN = 4
# Decode steps whose longest sequence is longer than this split more (`choose_num_splits`); CUDA graphs capture
# small batches twice, for sequences up to it and for longer ones (worker/cuda_graph.py).
LONG_DECODE_SEQ = 16384
# Prefill steps with a request adding at least this many tokens take 128 x 128 tiles on 8 warps where
# `choose_launch_config(..., large_tiles=True)`: cc >= 9.0 and 16-bit queries (96 KiB of shared memory at
# head_dim <= 128; float32 queries would need 256 KiB, past the H100/H200's 227).
LONG_PREFILL_QUERY = 8192


@dataclass(slots=True, frozen=True)
class AttentionLaunchConfig:
    """Tile sizes and launch settings of `paged_attention_kernel`."""

    block_q: int  # new tokens per program
    qpk_pad: int  # padded query heads per kv head
    block_n: int  # KV positions per loop step
    head_dim_pad: int
    num_warps: int
    num_stages: int

    @property
    def block_m(self) -> int:
        return self.block_q * self.qpk_pad


def choose_launch_config(
    max_query_len: int,
    num_queries_per_kv: int,
    head_dim: int,
    *,
    num_stages: int = 2,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    large_tiles: bool = False,
    small_shared: bool = False,
) -> AttentionLaunchConfig:
    """Pick tile sizes from host-side ints only (so CUDA graphs see a fixed launch).

    Decode-only steps (max_query_len <= DECODE_MAX_QUERY_LEN = 4) use 16-row
    tiles: one decode token times the GQA group fills a tile with little waste
    (32 q / 8 kv heads -> 4 tokens x 4 heads). Steps with a longer request use
    64 rows; in such a mixed step `paged_attention` hands the short requests to
    a second launch with the decode tiles (`choose_decode_launch_config`).
    BLOCK_N shrinks for head_dim 256 to keep the fp32 accumulator and K/V tiles
    in registers. `num_stages` comes from the platform (1 on sm_70, which has
    no cp.async). block_m, block_n, num_warps: overrides (tests, tuning).
    `large_tiles` (the caller's device has cc >= 9.0, the queries are 16-bit): steps with a request of
    >= LONG_PREFILL_QUERY new tokens and head_dim <= 128 take 128 x 128 tiles
    on 8 warps; on the H200 the last 16,384-token chunk of a 126k prompt took
    89.7 ms of attention a layer with them against 100.1 ms with 64 x 64 on 4
    (354 vs 317 TFLOP/s; `benchmarks/gpu/sweep_tiles.py --long`).
    `small_shared` (the caller's device allows 64 KiB of shared memory a block:
    cc 7.5, T4 / RTX 20xx): prefill steps at head_dim 256 take 32-row tiles on 4
    warps, 48 KiB (sm_75 compile); the 64-row ones need 80 KiB there.
    """
    qpk_pad = triton.next_power_of_2(num_queries_per_kv)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if (large_tiles and max_query_len >= LONG_PREFILL_QUERY and head_dim_pad <= 128 and num_stages > 1
            and qpk_pad <= 128):
        block_m = 128 if block_m is None else block_m
        block_n = 128 if block_n is None else block_n
        num_warps = 8 if num_warps is None else num_warps
    if small_shared and head_dim_pad >= 256 and max_query_len > DECODE_MAX_QUERY_LEN:
        block_m = 32 if block_m is None else block_m
        block_n = 16 if block_n is None else block_n
        num_warps = 4 if num_warps is None else num_warps
    if block_m is None:
        block_m = 16 if max_query_len <= DECODE_MAX_QUERY_LEN else 64
    block_m = max(block_m, qpk_pad, 16)
    if block_n is None:
        block_n = 64 if head_dim_pad <= 128 else 32
        if num_stages == 1 and head_dim_pad >= 256 and block_m >= 64:
            block_n = 16  # sm_7x (unpipelined): stay well under V100's 96 KiB shared memory
    if num_warps is None:
        num_warps = 8 if (block_m >= 64 and head_dim_pad >= 256) else 4
    return AttentionLaunchConfig(
        block_q=block_m // qpk_pad,
        qpk_pad=qpk_pad,
        block_n=block_n,
        head_dim_pad=head_dim_pad,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def choose_decode_launch_config(
    max_query_len: int, main: AttentionLaunchConfig, num_queries_per_kv: int, head_dim: int, *,
    num_stages: int = 2, block_n: int | None = None,
) -> AttentionLaunchConfig | None:
    """Tiles of a mixed step's decode launch (`paged_attention(split_decodes=True)`), or None for one launch.

    `main` is the step's own config (`choose_launch_config(max_query_len, ...)`). In a step with a request
    longer than DECODE_MAX_QUERY_LEN, the requests of 1..block_q new tokens run one program each with the
    decode-step tiles (those of max_query_len 1) instead of main's, doing main.block_q / block_q times less
    `tl.dot` work per KV tile (Llama-3.1-8B, 4 heads per kv head: 16 rows, not 64, for a decode's 4 real
    rows). None for decode-only steps and where the decode tiles hold no fewer tokens than main's (e.g. 64
    query heads per kv head: one token either way). A `block_n` override applies to both launches; block_m
    and num_warps overrides only to `main`.
    """
    if max_query_len <= DECODE_MAX_QUERY_LEN:
        return None
    dec = choose_launch_config(1, num_queries_per_kv, head_dim, num_stages=num_stages, block_n=block_n)
    return dec if dec.block_q < main.block_q else None


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(
    device: torch.device, max_query_len: int, num_reqs: int, num_kv_heads: int, max_seq_len: int | None
) -> int:
    """How many pieces to split each KV range into (1 = no split).

    Only decode steps (max_query_len <= DECODE_MAX_QUERY_LEN) on a GPU split, and only when the
    (request, kv head) programs cannot give every SM two of them; each split
    should still stream >= 256 positions. E.g. H200 (132 SMs), 8 kv heads:
    1 request at 8k context -> 16 splits; 64 requests -> 1. Past LONG_DECODE_SEQ
    the aim is four programs an SM and at most 64 splits (1 request at 126k -> 64):
    on the H200 one Llama-3.1-8B decode at 126k context took 270.7 us of attention
    a layer with 16 splits, 127.6 us with 64 (4.05 TB/s; `sweep_tiles.py --long`),
    while 64 splits at 1k context cost 11.0 us against 16's 8.2.
    """
    if device.type != "cuda" or max_query_len > DECODE_MAX_QUERY_LEN or not max_seq_len:
        return 1
    programs = max(1, num_reqs * num_kv_heads)
    index = device.index if device.index is not None else torch.cuda.current_device()
    per_sm, cap = (4, 64) if max_seq_len > LONG_DECODE_SEQ else (2, 16)
    want = -(-per_sm * _num_sms(index) // programs)  # ceil
    return max(1, min(cap, want, max_seq_len // 256))
