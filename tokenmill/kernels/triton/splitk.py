"""What the split-K GEMM kernels (`quant_linear.py`, `fp8_gemm.py`) share: their program -> (tile, K slice)
mapping, the reduction of their float32 partials and the device facts their planners size the split by.

Split-K writes float32 partials [SPLIT_K, M, N]; `splitk_reduce_kernel` sums them in a fixed order
(+ bias, cast): no atomics, deterministic, no host sync.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.numerics import round_to


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n): the output tile of program_id(0) in grouped order.

    GROUP_M row tiles sweep the column tiles together, so a weight tile is reused from L2 by the row tiles
    of its group.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    return pid_m, pid_n


@triton.jit
def k_slice(K, k_tiles_per_split, BLOCK_K: tl.constexpr):
    """(pid_k, k_start, k_end): program_id(1)'s K slice, K tiles [k_start, k_end) of BLOCK_K columns each."""
    pid_k = tl.program_id(1)
    k_start = pid_k * k_tiles_per_split
    k_end = tl.minimum(k_start + k_tiles_per_split, tl.cdiv(K, BLOCK_K))
    return pid_k, k_start, k_end


@triton.jit
def splitk_reduce_kernel(partial_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         CLAMP_FP16: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    """out[m, n] = sum over s of partial[s, m, n] in order s = 0, 1, ... (+ bias[n]), cast to out's dtype.

    partial float32 [SPLIT_K, M, N] contiguous (MN = M * N), bias [N], out [M, N] contiguous. CLAMP_FP16
    saturates at +-65504 (float16 outputs); ROUND (`numerics.round_code`, 0: none) rounds the float32 sum
    once to out's dtype in the kernel's own code (`numerics.round_to`) before the cast.
    """
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(partial_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    if CLAMP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    tl.store(out_ptr + offs, round_to(acc, ROUND).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, pid_k, rows, cols, offs_n, n_mask, mask, stride_os, stride_om, stride_on,
               HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, CLAMP_FP16: tl.constexpr):
    """Store the transposed output tile acc^T [BLOCK_N, R] (float32) at out[rows, cols] under `mask`.

    PARTIAL: the float32 partial of K slice pid_k at out[pid_k, rows, cols] (summed by
    `splitk.splitk_reduce_kernel`); else + bias[offs_n] (HAS_BIAS), saturated at +-65504 (CLAMP_FP16) and cast
    to out's dtype. `cols` are the output columns offs_n as the caller indexes out (int32 or int64).
    """
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + rows[None, :] * stride_om + cols[:, None] * stride_on, acc,
                 mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if CLAMP_FP16:
            acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
        tl.store(out_ptr + rows[None, :] * stride_om + cols[:, None] * stride_on,
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _device_facts(index: int) -> tuple[tuple[int, int], int]:
    from tokenmill.platforms.cuda import effective_capability, force_cc70_requested

    cap = effective_capability(torch.cuda.get_device_capability(index), force_cc70_requested())
    return cap, torch.cuda.get_device_properties(index).multi_processor_count


def device_facts(device: torch.device) -> tuple[tuple[int, int], int]:
    """(effective compute capability, SM count) of `device`, cached per device index.

    The capability is `platforms.cuda.effective_capability` (TOKENMILL_FORCE_CC70=1 gives (7, 0)); off CUDA
    (the Triton interpreter) (9, 0) and 132 (an H200).
    """
    if device.type != "cuda":
        return (9, 0), 132
    return _device_facts(device.index if device.index is not None else torch.cuda.current_device())
