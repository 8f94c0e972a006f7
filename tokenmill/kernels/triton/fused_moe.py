"""Fused MoE on CUDA: one Triton grouped-GEMM launch per projection.

The (token, expert) pairs of a step are sorted by expert and each expert's
run is padded to a multiple of BLOCK_M (`moe_align_block_size`), so every
BLOCK_M-row tile of the sorted list belongs to exactly one expert. One
program computes a `[BLOCK_M, BLOCK_N]` output tile of that expert:

    sorted pairs  | e0 e0 e0 pad | e1 pad pad pad | e3 e3 e3 e3 | e3 pad ... |
    tiles         |   tile 0     |    tile 1      |   tile 2    |  tile 3    |
    expert of tile     0               1                3            3

Launch 1 (w13, gate and up fused): rows of A are tokens (pair // top_k),
C [T * k, 2I]. Then act(gate) * up (one launch: `triton/activation.py` for
silu / gelu). Launch 2 (w2): rows of A are pairs, the routing weight is
applied to each row, C [T * k, H] (bfloat16 for bfloat16 models, float32
otherwise); `moe_sum_kernel` adds the top-k rows of a token in float32 and
rounds the sum (for bfloat16 models each pair's row was already rounded to
bfloat16 once, so two roundings; float32 rows: one). Expert biases (gpt-oss) are added in the GEMM epilogues before
the routing weight: C = w * (A @ B^T + bias[expert]). The scheme is the
grouped GEMM of MegaBlocks (Gale et al. 2022) and vLLM's fused_moe; written
here from that description. Sorting (`moe_align.py`) needs no host sync (the
tile count is bounded statically).

Launch settings: `GroupedGemmConfig` per projection, defaults from
`_TABLE` by pairs per expert (benchmarks/gpu/sweep_moe.py times the
candidates and prints a replacement table).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace

import torch
import triton
import triton.language as tl

from tokenmill.kernels.moe_activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT, act_and_mul
# Re-exported: the quantized grouped GEMMs (fused_moe_quant / _mxfp4 / FP8) import the sort from here.
from tokenmill.kernels.triton.moe_align import moe_align_block_size
from tokenmill.kernels.triton.splitk import device_facts

__all__ = ["GroupedGemmConfig", "default_gemm_configs", "expert_activation", "fused_experts_triton",
           "grouped_gemm_kernel", "moe_align_block_size", "moe_sum", "tile_pairs"]


@triton.jit
def tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs, TOP_K_DIV: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """The pairs of sorted tile pid_m (`moe_align_block_size`'s layout) and where their rows come from.

    Returns (pair_ids int64 [BLOCK_M], pair_mask [BLOCK_M] (False on padding), expert int64 (the tile's),
    a_rows [BLOCK_M]: the A row of each pair, pair // TOP_K_DIV, 0 on padding).
    """
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair_ids = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    pair_mask = pair_ids < num_pairs
    expert = tl.load(tile_expert_ids_ptr + pid_m).to(tl.int64)
    a_rows = tl.where(pair_mask, pair_ids // TOP_K_DIV, 0)
    return pair_ids, pair_mask, expert, a_rows


@triton.jit(do_not_specialize=["num_pairs", "num_m_tiles"])
def grouped_gemm_kernel(
    a_ptr,  # [num_a_rows, K]
    b_ptr,  # [E, N, K] expert weights (nn.Linear layout)
    c_ptr,  # [num_pairs, N]
    bias_ptr,  # [E, N] (read when HAS_BIAS)
    topk_weights_ptr,  # [num_pairs] float32 (read when MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [num_m_tiles * BLOCK_M] int32; num_pairs = padding
    tile_expert_ids_ptr,  # [num_m_tiles] int32
    num_pairs_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    num_m_tiles,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    stride_bias_e,
    TOP_K_DIV: tl.constexpr,  # A row of pair p is p // TOP_K_DIV (top_k for w13, 1 for w2)
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE_FP32: tl.constexpr,  # exact fp32 dots (no TF32) for float32 models
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # <= 1: M tiles fastest (every expert's tiles of one N block run together)
):
    # 1-D grid over (M tile, N tile). GROUP_M > 1 walks GROUP_M M tiles across all N tiles before the next
    # group (the A rows of the group stay in L2); otherwise M tiles are fastest (one expert N block shared).
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    if GROUP_M > 1:
        in_group = GROUP_M * num_n_tiles
        first_m = (pid // in_group) * GROUP_M
        group_size = min(num_m_tiles - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_size
        pid_n = (pid % in_group) // group_size
    else:
        pid_m = pid % num_m_tiles
        pid_n = pid // num_m_tiles
    # Tiles past the padded total exist only because the grid is sized statically.
    if pid_m * BLOCK_M >= tl.load(num_pairs_post_padded_ptr):
        return
    pair_ids, pair_mask, expert, a_rows = tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs,
                                                     TOP_K_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    # B tile read transposed, [BLOCK_K, BLOCK_N], so C = A @ B^T as nn.Linear.
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE_FP32:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        w = tl.load(topk_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair_ids[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pair_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def moe_sum_kernel(x_ptr, out_ptr, num_tokens, H, TOP_K: tl.constexpr, CLAMP_FP16: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """out[t] = sum_j x[t * TOP_K + j] in float32, rounded once to out's dtype; x [T * TOP_K, H], out [T, H]."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * H + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(x: torch.Tensor, top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum of each token's top-k rows in one launch: x [T * top_k, H] contiguous -> [T, H] `dtype`
    (float32 accumulation, one rounding; float16 clamped to its finite range)."""
    num_pairs, hidden = x.shape
    out = torch.empty(num_pairs // top_k, hidden, dtype=dtype, device=x.device)
    if out.numel():
        block_h = min(1024, triton.next_power_of_2(hidden))
        moe_sum_kernel[(out.shape[0], triton.cdiv(hidden, block_h))](
            x, out, out.shape[0], hidden, TOP_K=top_k, CLAMP_FP16=dtype == torch.float16, BLOCK_H=block_h,
            num_warps=4)
    return out


@dataclass(frozen=True, slots=True)
class GroupedGemmConfig:
    """Launch settings of `grouped_gemm_kernel` for one projection (0: the default from `_TABLE`).

    block_m is shared by both projections of a call (one sort); block_n / block_k are powers of two >= 16.
    group_m > 1 swizzles the grid (see the kernel); num_warps / num_stages go to the Triton launch.
    """

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    group_m: int = 0
    num_warps: int = 0
    num_stages: int = 0


_C = GroupedGemmConfig
# 16-bit experts on cc >= 8.0: (max pairs per expert, w13 [gate|up] config, w2 config); the first row whose
# bound is >= num_pairs / E applies. Pairs per expert: Qwen3-30B-A3B (E 128, top-8) has T / 16, gpt-oss-20b
# (E 32, top-4) T / 8. The rows are the best tiles of an H200 sweep at Qwen3-30B-A3B's shapes
# (benchmarks/gpu/sweep_moe.py, session9/visit3/moesweep.log: T = 1, 16, 256, 1024, 4096), each row's bound
# between its T's pairs per expert and the next's; they were 0.3-3.6% faster per layer than the starting
# points before (346.6 -> 334.0 us at T = 256). At gpt-oss-20b's shapes the same sweep found other tiles
# up to 9% faster at T = 256 (64 x 128 x 64, 4 warps); its real checkpoints run the MXFP4 kernel instead.
# Compiled without the launch's specializations, the 16 x 64 x 256 and 128 x 256 x 64 tiles spill a few KB of
# registers on sm_90 (the review's ptxas -v); they were timed fastest as launched, so they are kept.
_TABLE: tuple[tuple[float, GroupedGemmConfig, GroupedGemmConfig], ...] = (
    (0.25, _C(16, 32, 128, 0, 4, 4), _C(16, 64, 128, 0, 4, 3)),
    (4.0, _C(16, 64, 256, 0, 4, 3), _C(16, 64, 128, 0, 4, 3)),
    (32.0, _C(32, 128, 128, 0, 8, 3), _C(32, 64, 128, 0, 4, 3)),
    (128.0, _C(128, 128, 64, 8, 8, 3), _C(128, 128, 64, 8, 8, 3)),
    (math.inf, _C(128, 256, 64, 8, 8, 3), _C(128, 256, 64, 8, 8, 3)),
)


def _fallback_config(num_pairs: int) -> GroupedGemmConfig:
    """float32 (exact dots, twice the shared memory per tile) and cc < 8.0: the settings before the table."""
    return GroupedGemmConfig(16 if num_pairs <= 1024 else 64, 64, 32, 0, 4, 3)


def _merge(default: GroupedGemmConfig, override: GroupedGemmConfig | None) -> GroupedGemmConfig:
    if override is None:
        return default
    return replace(default, **{f.name: getattr(override, f.name) for f in fields(override)
                               if getattr(override, f.name)})


def default_gemm_configs(num_pairs: int, num_experts: int, dtype: torch.dtype, device: torch.device,
                         w13_config: GroupedGemmConfig | None = None, w2_config: GroupedGemmConfig | None = None,
                         block_m: int | None = None) -> tuple[GroupedGemmConfig, GroupedGemmConfig]:
    """Full launch settings of both projections: `_TABLE`'s row for num_pairs / num_experts (16-bit, cc >= 8.0;
    the fixed fallback otherwise), overridden field by field by the non-zero fields of w13_config / w2_config.

    The block_m of the result: w13_config's, else w2_config's, else `block_m`, else the table's.

    Raises:
        ValueError: w13_config and w2_config set different block_m (both projections share one sort).
    """
    cap = tuple(device_facts(device)[0])
    return _configs(num_pairs, num_experts, dtype == torch.float32 or cap < (8, 0), w13_config, w2_config, block_m)


@functools.lru_cache(maxsize=1024)  # once per batch size and model: the forward stays light on the host
def _configs(num_pairs: int, num_experts: int, fallback: bool, w13_config: GroupedGemmConfig | None,
             w2_config: GroupedGemmConfig | None, block_m: int | None) -> tuple[GroupedGemmConfig, GroupedGemmConfig]:
    m13 = w13_config.block_m if w13_config is not None else 0
    m2 = w2_config.block_m if w2_config is not None else 0
    if m13 and m2 and m13 != m2:
        raise ValueError(f"w13_config.block_m {m13} and w2_config.block_m {m2} differ; both projections share one "
                         "sort by expert, so set one block_m (or the same one in both).")
    if fallback:
        d13 = d2 = _fallback_config(num_pairs)
    else:
        per_expert = num_pairs / max(1, num_experts)
        d13, d2 = next((c13, c2) for bound, c13, c2 in _TABLE if per_expert <= bound)
    c13, c2 = _merge(d13, w13_config), _merge(d2, w2_config)
    bm = m13 or m2 or block_m or d13.block_m
    return replace(c13, block_m=bm), replace(c2, block_m=bm)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
                  topk_weights: torch.Tensor | None, aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  top_k_div: int, cfg: GroupedGemmConfig) -> None:
    sorted_pair_ids, tile_expert_ids, num_post = aligned
    num_pairs, n = c.shape
    num_m_tiles = tile_expert_ids.numel()
    grid = (num_m_tiles * triton.cdiv(n, cfg.block_n),)
    grouped_gemm_kernel[grid](
        a, b, c, bias if bias is not None else c, topk_weights if topk_weights is not None else c,
        sorted_pair_ids, tile_expert_ids, num_post,
        n, b.shape[2], num_pairs, num_m_tiles,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0,
        TOP_K_DIV=top_k_div, HAS_BIAS=bias is not None, MUL_ROUTED_WEIGHT=topk_weights is not None,
        IEEE_FP32=a.dtype == torch.float32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def expert_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of [P, 2I] rows in one launch where a Triton kernel has the same formula (silu, gelu
    tanh, gpt-oss's swigluoai: `triton/activation.py`, bit-equal to PyTorch on CUDA) unless the fused kernels
    are off (`kernels.use_fused_kernels`: CPU tensors, TOKENMILL_DISABLE_FUSED_KERNELS);
    `moe_activation.act_and_mul` otherwise."""
    from tokenmill.kernels import use_fused_kernels

    if activation in ("silu", "gelu", "swigluoai") and gate_up.shape[0] and use_fused_kernels(gate_up):
        from tokenmill.kernels.triton.activation import gelu_and_mul, silu_and_mul, swiglu_oai_and_mul

        if activation == "swigluoai":
            return swiglu_oai_and_mul(gate_up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT)
        return silu_and_mul(gate_up) if activation == "silu" else gelu_and_mul(gate_up, "tanh")
    return act_and_mul(gate_up, activation)


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    block_m: int | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_config: GroupedGemmConfig | None = None,
    w2_config: GroupedGemmConfig | None = None,
) -> torch.Tensor:
    """Same contract as `fused_experts_reference`, computed with two grouped-GEMM launches.

    Args:
        hidden_states: [T, H]; w13: [E, 2I, H]; w2: [E, H, I] (same dtype,
            float16 / bfloat16 / float32, contiguous experts).
        topk_weights: [T, k]; topk_ids: [T, k] in [0, E).
        block_m: rows per tile (16 or more, a power of two); default from
            `default_gemm_configs` (by pairs per expert).
        w13_bias: [E, 2I] or None; w2_bias: [E, H] or None (see the reference).
        w13_config / w2_config: launch settings of each projection
            (`GroupedGemmConfig`, zero fields: the default); tests and sweeps.

    Returns:
        [T, H] in hidden_states' dtype.

    Raises:
        ValueError: the two configs set different block_m.
    """
    num_tokens, hidden_size = hidden_states.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    dtype = hidden_states.dtype
    cfg13, cfg2 = default_gemm_configs(num_pairs, w13.shape[0], dtype, hidden_states.device, w13_config,
                                       w2_config, block_m)
    aligned = moe_align_block_size(topk_ids, cfg13.block_m, w13.shape[0])
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=dtype, device=hidden_states.device)
    _grouped_gemm(hidden_states, w13, gate_up, w13_bias, None, aligned, top_k, cfg13)
    inter = expert_activation(gate_up, activation)
    # The weighted expert outputs in bfloat16 for bfloat16 models (half the bytes of float32; the sum below
    # is still in float32); float32 for float16 (its range) and float32 models.
    down = torch.empty(num_pairs, hidden_size, dtype=dtype if dtype == torch.bfloat16 else torch.float32,
                       device=hidden_states.device)
    pair_weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(inter, w2, down, w2_bias, pair_weights, aligned, 1, cfg2)
    return moe_sum(down, top_k, dtype)
