"""Fused MoE with FP8 (e4m3) expert weights on CUDA: grouped GEMMs on the experts' e4m3 bytes, W8A8 or weight-only.

Same scheme as `fused_moe.py` (its `moe_align_block_size` sorts the
(token, expert) pairs by expert into BLOCK_M-row tiles of one expert each;
launch 1 computes [gate | up] = x @ w13[e]^T (+ b13[e]) per pair, then
`fused_moe.expert_activation`; launch 2 the routing-weighted rows of
inter @ w2[e]^T (+ b2[e]), summed over the top-k slots in float32 by
`fused_moe.moe_sum`). The B
operand is the experts' e4m3 bytes (`kernels/fp8.py` format); each program
reads only its tile's expert's [BLOCK_N, BLOCK_K] bytes and computes
acc^T [BLOCK_N, BLOCK_M] = W_tile @ A_tile^T (as the int4 and MXFP4 MoE kernels).
Two modes (`uses_w8a8` picks; `fused_experts_fp8_triton(quantize_activations=False)`
forces weight-only, for comparisons):

- W8A8, effective cc >= 8.9 (FP8 tensor cores; `splitk.device_facts` honours
  TOKENMILL_FORCE_CC70), 16-bit activations, a checkpoint that quantizes
  activations: as the dense `fp8_gemm.py`, x is quantized once per token (per
  1 x Bk group for block weights; with a static input scale when given) by
  `fp8_quant.quantize_fp8_triton`, the activated intermediate rows again before
  w2; the weight tile is loaded as float8e4nv (no decode) and multiplied by the
  e4m3 activation tile in an fp8 `tl.dot` with max_num_imprecise_acc=BLOCK_K
  (every BLOCK_K-deep partial product promoted to float32: sm_90's fp8 wgmma
  keeps ~14 bits of its running sum otherwise); activation scales multiply the
  accumulator per K tile (groups) or once at the end (per token / static).
- Weight-only (W8A16): cc < 8.9, float32 activations, weight-only checkpoints.
  The bytes are decoded with integer operations (`fp8_quant.e4m3_to_f16_div256`,
  the dense FP8 GEMM's decode: no FP8 instruction, so it also compiles for
  sm_70) to float16 holding value / 256, exact, then to the activation dtype
  (float16 -> bfloat16 is exact for these values), and the tile goes to
  `tl.dot` from registers. bfloat16: decoding e4m3 straight into bfloat16 bits
  with the float16 trick (value * 2^-120) is unsafe, e4m3's subnormals would
  land on bfloat16 subnormals, which an MMA may flush; an exact direct decode
  (e4m3 subnormals encoded with exponent 1, then 2^-6 subtracted in bfloat16:
  Sterbenz-exact) was tried and dropped: ptxas already turns float16 -> float32
  -> bfloat16 into one HADD2.F32 per element and one F2FP pack per two, while
  the direct decode's compares and selects added 28% more SASS instructions to
  the sm_90 kernel (BLOCK_M 16: 1,824 vs 1,424; 14-28% over the default rows,
  18-27% on sm_80; counted with cuobjdump, not timed).

Scales (float32), applied to the float32 accumulator, never to the 16-bit tile:

    per-tensor   [E] / [E, 1]                         one per expert, after the K loop
    per-channel  [E, N] / [E, N, 1]                   one per output row, after the K loop
    block        [E, ceil(N / Bn), ceil(K / Bk)]      per K tile (BLOCK_K divides Bk):
                                                      acc += (W_tile @ A^T) * s[n // Bn, k0 // Bk]

so every weight-only product is e4m3 value x activation, exact in the dot's
float32 accumulator, and the result differs from "dequantize in float32,
multiply in float32" only by summation order and by the rounding of the
intermediate [gate | up] rows to the activation dtype (W8A8: on the quantized
activations, plus the fp8 MMA's truncation inside each BLOCK_K-deep sum). FusedMoE stores block scales
repeated per row (`layers/fp8_params.py`: [E, N, ceil(K / Bk)], i.e. Bn = 1).

Compared with the path this replaced (dequantize all E experts of a layer to
16 bits per forward, then the 16-bit grouped GEMM): weights are read once at
1 byte each, only for the experts the step routes to, and no dense copy is
written (Qwen3-30B-A3B: 1.2 GB per layer in bfloat16 before).

Interpreter (TRITON_INTERPRET=1, CPU tests): its bfloat16 `tl.dot` is wrong
(see `fp8_gemm.py`), so bfloat16 tiles are multiplied there as exact float32
dots (the same products); its fp8 loads and fp8 dots are exact, so W8A8 runs
as on the GPU minus the MMA's truncation. cc < 8.0: the same kernel, one stage, smaller tiles;
Triton lowers `tl.dot` to FMAs there (shared/PLATFORMS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.fp8 import FP8_DTYPE, fp8_bits
from tokenmill.kernels.triton.fp8_gemm import block_k_for_scales
from tokenmill.kernels.triton.fp8_quant import e4m3_to_f16_div256, quantize_fp8_triton
from tokenmill.kernels.triton.fused_moe import expert_activation, moe_align_block_size, moe_sum, tile_pairs
from tokenmill.kernels.triton.numerics import round_code, round_to, use_libdevice
from tokenmill.kernels.triton.splitk import device_facts


@triton.jit
def grouped_fp8_gemm_kernel(
    a_ptr,  # [num_a_rows, K]: float8_e4m3fn when A_FP8, else float16 / bfloat16 / float32
    w_ptr,  # [E, N, K]: the float8_e4m3fn experts when A_FP8, else their uint8 bits
    s_ptr,  # float32 scales, addressed [E, rows, K blocks] by the strides below (module docstring)
    a_scale_ptr,  # float32 activation scales (A_FP8): [num_a_rows, groups] or one static scale (stride_asm 0)
    bias_ptr,  # [E, N] (read when HAS_BIAS)
    c_ptr,  # [num_pairs, N]
    topk_weights_ptr,  # [num_pairs] float32 (read when MUL_ROUTED_WEIGHT)
    sorted_pair_ids_ptr,  # [max_tiles * BLOCK_M] int32; num_pairs = padding
    tile_expert_ids_ptr,  # [max_tiles] int32
    num_pairs_post_padded_ptr,  # [1] int32
    N, K, num_pairs,
    scale_block_n,  # output rows per scale row (1 per-channel / Bn block; stride_sn 0 for per-tensor)
    scale_block_k,  # K columns per scale column (BLOCK_SCALES)
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_be,
    stride_cm, stride_cn, stride_asm, stride_asg,
    TOP_K_DIV: tl.constexpr,  # A row of pair p is p // TOP_K_DIV (top_k for w13, 1 for w2)
    MUL_ROUTED_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,  # scales vary along K: applied per K tile
    A_FP8: tl.constexpr,  # W8A8: e4m3 activations, fp8 dots; else the weight's bits decoded to 16 bits
    A_GROUP: tl.constexpr,  # activation scales per row and scale_block_k-wide group (applied per K tile)
    IEEE_FP32: tl.constexpr,  # exact float32 dots: float32 activations, and bfloat16 in the interpreter
    CLAMP_FP16: tl.constexpr,
    ROUND: tl.constexpr,  # numerics.round_code of c's dtype
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # divides scale_block_k when BLOCK_SCALES
):
    """One [BLOCK_M, BLOCK_N] output tile of one expert: rows are the tile's (token, expert) pairs (sorted by
    `fused_moe.moe_align_block_size`), C[pair] = A[pair // TOP_K_DIV] @ (q[expert] * s[expert])^T (+ bias[expert])
    (times the pair's routing weight when MUL_ROUTED_WEIGHT), float32 accumulation: fp8 dots on e4m3 activations
    (A_FP8, A[r] = q_a[r] * a_scale[r, group]) or the e4m3 bytes decoded tile by tile inside the K loop.
    Grid (tiles, cdiv(N, BLOCK_N)); tiles past the padded total return.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Tiles past the padded total exist only because the grid is sized statically.
    if pid_m * BLOCK_M >= tl.load(num_pairs_post_padded_ptr):
        return
    pair_ids, pair_mask, expert, a_rows = tile_pairs(sorted_pair_ids_ptr, tile_expert_ids_ptr, pid_m, num_pairs,
                                                     TOP_K_DIV, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + expert * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wk
    a_ptrs = a_ptr + a_rows[None, :] * stride_am + offs_k[:, None] * stride_ak
    s_rows = s_ptr + expert * stride_se + (offs_n // scale_block_n) * stride_sn
    # Transposed: acc^T [BLOCK_N, BLOCK_M] = W_tile [BLOCK_N, BLOCK_K] @ A_tile^T (the decoded tile is the dot's
    # A operand, straight from registers).
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kt * BLOCK_K
        if A_FP8:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            a_t = tl.load(a_ptrs, mask=k_mask[:, None] & pair_mask[None, :], other=0.0)
            # As fp8_gemm: every BLOCK_K-deep partial product is promoted to float32 (sm_90's fp8 wgmma keeps
            # ~14 bits of its running sum otherwise).
            part = tl.dot(w, a_t, max_num_imprecise_acc=BLOCK_K)
            if BLOCK_SCALES:
                s = tl.load(s_rows + (kt * BLOCK_K // scale_block_k) * stride_sk, mask=n_mask, other=0.0)
                part = part * s[:, None]
            if A_GROUP:
                sa = tl.load(a_scale_ptr + a_rows * stride_asm + (kt * BLOCK_K // scale_block_k) * stride_asg,
                             mask=pair_mask, other=0.0)
                part = part * sa[None, :]
            acc += part
        else:
            bits = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
            a_t = tl.load(a_ptrs, mask=k_mask[:, None] & pair_mask[None, :], other=0.0)
            w = e4m3_to_f16_div256(bits)  # value / 256, exact
            if BLOCK_SCALES:
                if IEEE_FP32:
                    part = tl.dot(w.to(tl.float32), a_t.to(tl.float32), input_precision="ieee")
                else:
                    part = tl.dot(w.to(a_t.dtype), a_t)
                s = tl.load(s_rows + (kt * BLOCK_K // scale_block_k) * stride_sk, mask=n_mask, other=0.0)
                acc += part * s[:, None]
            else:
                if IEEE_FP32:
                    acc = tl.dot(w.to(tl.float32), a_t.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(w.to(a_t.dtype), a_t, acc)
        w_ptrs += BLOCK_K * stride_wk
        a_ptrs += BLOCK_K * stride_ak
    if A_FP8:
        if not A_GROUP:  # per token (stride_asm 1) or static (stride_asm 0)
            acc = acc * tl.load(a_scale_ptr + a_rows * stride_asm, mask=pair_mask, other=0.0)[None, :]
    else:
        acc = acc * 256.0  # the decode's value / 256 (exact: a power of two)
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_rows, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if MUL_ROUTED_WEIGHT:
        rw = tl.load(topk_weights_ptr + pair_ids, mask=pair_mask, other=0.0)
        acc = acc * rw[None, :]
    if CLAMP_FP16:
        acc = tl.minimum(tl.maximum(acc, -65504.0), 65504.0)
    c_ptrs = c_ptr + pair_ids[None, :] * stride_cm + offs_n[:, None] * stride_cn
    tl.store(c_ptrs, round_to(acc, ROUND).to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & pair_mask[None, :])


@dataclass(frozen=True, slots=True)
class Fp8MoeConfig:
    """Launch settings of both grouped GEMMs of `fused_experts_fp8_triton` (0: the default table's value).

    block_m: pairs per tile (a power of two >= 16); block_n: output rows per program; block_k: K columns per
    tile (a power of two >= 16; with block scales the largest power of two <= it that divides Bk is used).
    """

    block_m: int = 0
    block_n: int = 0
    block_k: int = 0
    num_warps: int = 0
    num_stages: int = 0


# Default launch settings by the number of (token, expert) pairs: the first row whose bound is >= the pairs.
# Not yet swept on a GPU (benchmarks/gpu/fp8_moe.py --sweep does); chosen from the 16-bit, int4 and MXFP4
# grouped GEMMs' H200 results, and sized to compile for sm_90 without register spills (the decoded weight tile
# lives in registers; tests/kernels/test_fp8_moe_compile.py checks each row with block scales):
# - up to 1024 pairs (decode; 128 tokens at top-8): BLOCK_M 16, most tiles hold one or two pairs and the step
#   is bound by reading the routed experts' bytes; 64 x 128 weight tiles (8 KB of e4m3 per K tile).
# - up to 4096 pairs: BLOCK_M 32 (a 128-expert layer averages 8-32 pairs per expert), 8 warps.
# - beyond: BLOCK_M 64, each decoded weight tile reused by 64 rows; 128 x 64 weight tiles, 8 warps (4 warps spill).
DEFAULT_CONFIGS: tuple[tuple[int, Fp8MoeConfig], ...] = (
    (1024, Fp8MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)),
    (4096, Fp8MoeConfig(block_m=32, block_n=64, block_k=128, num_warps=8, num_stages=3)),
    (1 << 62, Fp8MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)),
)
# W8A8 (cc >= 8.9): no decoded tile in registers, so the dense FP8 GEMM's tiles (`fp8_gemm.plan_fp8_gemm`): K tiles
# of 128 (one scale block each), 128 output rows per program from 1024 pairs. The fp8 dot's M is BLOCK_N (the
# transposed product): 64 rows per warpgroup on sm_90, so 8 warps only with BLOCK_N 128. Not yet swept on a GPU.
DEFAULT_CONFIGS_W8A8: tuple[tuple[int, Fp8MoeConfig], ...] = (
    (1024, Fp8MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)),
    (4096, Fp8MoeConfig(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=3)),
    (1 << 62, Fp8MoeConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)),
)
# cc < 8.0 (V100; float16, FMA dots): one stage (no cp.async) and 32 x 32 weight tiles, the sizes the MXFP4 MoE
# kernel compiles to without register spills on sm_70; BLOCK_M 32 from 512 pairs.
DEFAULT_CONFIGS_CC70: tuple[tuple[int, Fp8MoeConfig], ...] = (
    (512, Fp8MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)),
    (1 << 62, Fp8MoeConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)),
)


def launch_config(num_pairs: int, capability: tuple[int, int], config: Fp8MoeConfig | None = None,
                  w8a8: bool = False) -> Fp8MoeConfig:
    """The settings for `num_pairs` (token, expert) pairs on a device of `capability` (W8A8 fp8 dots or
    weight-only): the default table's row, with the nonzero fields of `config` in its place.

    Raises:
        ValueError: block_m, block_n or block_k is not a power of two >= 16.
    """
    table = DEFAULT_CONFIGS_CC70 if tuple(capability) < (8, 0) else DEFAULT_CONFIGS_W8A8 if w8a8 else DEFAULT_CONFIGS
    cfg = next(c for bound, c in table if num_pairs <= bound)
    if config is not None:
        cfg = replace(cfg, **{f: v for f in ("block_m", "block_n", "block_k", "num_warps", "num_stages")
                              if (v := getattr(config, f))})
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"Fp8MoeConfig.{name} must be a power of two >= 16, not {v}.")
    return cfg


class ExpertScales(NamedTuple):
    """The scales of stacked FP8 experts as `grouped_fp8_gemm_kernel` addresses them."""

    scale: torch.Tensor  # float32
    stride_e: int  # between experts
    stride_n: int  # between scale rows (0: one scale per expert)
    stride_k: int  # between K blocks (block scales)
    block_n: int  # output rows per scale row
    block_k: int  # K columns per scale column (block scales)
    along_k: bool  # block scales: they vary along K


def expert_scales(w: torch.Tensor, s: torch.Tensor, block_size: tuple[int, int] | None, name: str) -> ExpertScales:
    """The `ExpertScales` of `name`'s scales `s` for experts w [E, N, K] (module docstring for the shapes).

    Raises:
        ValueError: the scale's shape fits no scheme for w.
    """
    e, n, k = w.shape
    s = s.float()
    if block_size is not None:
        bn, bk = block_size
        want = (e, -(-n // bn), -(-k // bk))
        if bn <= 0 or bk <= 0 or tuple(s.shape) != want:
            raise ValueError(f"Block scales of FP8 experts {name} [{e}, {n}, {k}] with blocks {list(block_size)} "
                             f"must be {list(want)}, not {list(s.shape)}.")
        return ExpertScales(s, s.stride(0), s.stride(1), s.stride(2), bn, bk, True)
    if tuple(s.shape) in ((e,), (e, 1)):
        return ExpertScales(s, s.stride(0), 0, 0, 1, 1, False)
    if tuple(s.shape) in ((e, n), (e, n, 1)):
        return ExpertScales(s, s.stride(0), s.stride(1), 0, 1, 1, False)
    raise ValueError(f"Scales of FP8 experts {name} [{e}, {n}, {k}] must be [{e}] / [{e}, 1] (per expert), "
                     f"[{e}, {n}] (per channel) or, with block_size, [{e}, ceil({n} / Bn), ceil({k} / Bk)]; "
                     f"got {list(s.shape)}.")


def _new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Uninitialized output buffers (tests replace it to check that every element gets written)."""
    return torch.empty(shape, dtype=dtype, device=device)


def grouped_fp8_gemm(a: torch.Tensor, w: torch.Tensor, scales: ExpertScales, bias: torch.Tensor | None, c: torch.Tensor,
                     topk_weights: torch.Tensor | None, aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     top_k_div: int, cfg: Fp8MoeConfig, a_scale: torch.Tensor | None = None) -> None:
    """One launch of `grouped_fp8_gemm_kernel`: c [num_pairs, N] from a [rows, K], w [E, N, K] (uint8 bits or
    float8_e4m3fn), scales = `expert_scales(w, ...)`, aligned = `moe_align_block_size(ids, cfg.block_m, E)`
    (benchmarks time it). W8A8 when a is float8_e4m3fn: a_scale float32 from `quantize_fp8_triton` ([rows, 1]
    per row, [rows, ceil(K / Bk)] per group of the weights' Bk, or [1] static); else weight-only."""
    sorted_pair_ids, tile_expert_ids, num_post = aligned
    num_pairs, n = c.shape
    s = scales
    block_k = block_k_for_scales(s.block_k, cfg.block_k) if s.along_k else cfg.block_k
    a_fp8 = a.dtype == FP8_DTYPE
    a_group = a_fp8 and a_scale.dim() == 2 and a_scale.shape[1] > 1
    assert not a_group or (s.along_k and a_scale.shape[1] == triton.cdiv(w.shape[2], s.block_k)), \
        "activation groups must be the weights' K blocks"
    ieee = a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and not use_libdevice(a))
    grid = (tile_expert_ids.numel(), triton.cdiv(n, cfg.block_n))
    grouped_fp8_gemm_kernel[grid](
        a, w.view(FP8_DTYPE) if a_fp8 else fp8_bits(w), s.scale, a_scale if a_fp8 else s.scale,
        bias if bias is not None else c, c, topk_weights if topk_weights is not None else c,
        sorted_pair_ids, tile_expert_ids, num_post,
        n, w.shape[2], num_pairs, s.block_n, s.block_k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), s.stride_e, s.stride_n, s.stride_k,
        bias.stride(0) if bias is not None else 0, c.stride(0), c.stride(1),
        a_scale.stride(0) if a_fp8 and a_scale.dim() == 2 else 0,
        a_scale.stride(1) if a_fp8 and a_scale.dim() == 2 else 0,
        TOP_K_DIV=top_k_div, MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_BIAS=bias is not None,
        BLOCK_SCALES=s.along_k, A_FP8=a_fp8, A_GROUP=a_group, IEEE_FP32=ieee and not a_fp8,
        CLAMP_FP16=c.dtype == torch.float16, ROUND=round_code(c.dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def quantize_rows(x: torch.Tensor, scales: ExpertScales,
                  static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8 activations for experts with `scales`: x [rows, K] -> (q float8_e4m3fn [rows, K], scale float32), one
    `quantize_fp8_triton` launch: with the static per-tensor `static_scale` ([1]), else per row and K block of
    block weights ([rows, ceil(K / Bk)], DeepSeek-V3's 1 x 128), else per row ([rows, 1])."""
    if static_scale is not None:
        return quantize_fp8_triton(x, scale=static_scale)
    return quantize_fp8_triton(x, group_size=scales.block_k if scales.along_k else None)


def uses_w8a8(dtype: torch.dtype, capability: tuple[int, int], quantize_activations: bool) -> bool:
    """True when `fused_experts_fp8_triton` quantizes the activations (W8A8): asked, FP8 tensor cores
    (effective capability >= 8.9) and 16-bit activations (float32 ones stay weight-only, exact)."""
    return quantize_activations and tuple(capability) >= (8, 9) and dtype in (torch.float16, torch.bfloat16)


def fused_experts_fp8_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    config: Fp8MoeConfig | None = None,
    quantize_activations: bool = True,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`fused_experts_reference` with FP8 e4m3 expert weights: W8A8 fp8 grouped GEMMs, or weight-only ones decoding
    the e4m3 bytes in the kernel (`uses_w8a8` picks; module docstring).

    Args:
        hidden_states: [T, H] bfloat16 / float16 / float32.
        w13: [E, 2I, H] float8_e4m3fn (or its uint8 bits), `[gate; up]` rows; w2: [E, H, I].
        w13_scale, w2_scale: float32 (any float dtype, used as float32): per expert [E] / [E, 1], per output
            channel [E, N] / [E, N, 1], or with block_size [E, ceil(N / Bn), ceil(K / Bk)]; W = q * scale.
        topk_weights: [T, k] routing weights; topk_ids: [T, k] expert ids in [0, E).
        activation: `moe_activation.act_and_mul`'s name.
        w13_bias: [E, 2I] or None; w2_bias: [E, H] or None (added before the routing weight).
        block_size: (Bn, Bk) of block scales (Qwen3-FP8 / DeepSeek: (128, 128); FusedMoE's per-row copies:
            (1, Bk)), or None.
        config: launch settings (`Fp8MoeConfig`); None: the default table (`launch_config`) by the number of pairs.
        quantize_activations: W8A8 where `uses_w8a8` allows (cc >= 8.9, 16-bit activations): x quantized per
            token (per 1 x Bk group with block scales) for w13, the activated intermediate rows again for w2;
            False: weight-only on every device (benchmarks compare both).
        w13_input_scale, w2_input_scale: static per-tensor activation scales ([1] float32) of a W8A8 checkpoint,
            used instead of the dynamic ones; None: dynamic.

    Returns:
        [T, H] in hidden_states' dtype: sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]),
        e = topk_ids[t, j], W = `fp8.dequantize_fp8` of each expert (float32); the [gate | up] rows are rounded
        to hidden_states' dtype (as the 16-bit path), the down rows and their top-k sum are float32. W8A8: x and
        the activated rows replaced by their quantize-dequantize (`fp8.quantize_fp8_per_row` / `_per_group` /
        `_per_tensor`) and the products summed in float32 every BLOCK_K (on sm_90 the fp8 MMA truncates inside
        each BLOCK_K-deep partial sum: tests/kernels/test_fp8_gemm.py's E_ACC_FP8_MMA).

    Raises:
        ValueError: the weights' shapes disagree with each other or with H, a weight is not float8_e4m3fn / uint8,
            a scale fits no scheme, or `config` has a bad tile size.
    """
    num_tokens, hidden_size = hidden_states.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"FP8 experts must be w13 [E, 2I, H] and w2 [E, H, I], not {tuple(w13.shape)} and "
                         f"{tuple(w2.shape)}.")
    num_experts, two_inter, _ = w13.shape
    if w13.shape[2] != hidden_size or w2.shape[:2] != (num_experts, hidden_size) or 2 * w2.shape[2] != two_inter:
        raise ValueError(f"FP8 experts w13 {list(w13.shape)} and w2 {list(w2.shape)} do not fit hidden size "
                         f"{hidden_size} (w13 must be [E, 2I, H], w2 [E, H, I]).")
    w13_bits, w2_bits = fp8_bits(w13), fp8_bits(w2)
    s13 = expert_scales(w13_bits, w13_scale, block_size, "w13")
    s2 = expert_scales(w2_bits, w2_scale, block_size, "w2")
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    cap, _ = device_facts(hidden_states.device)
    w8a8 = uses_w8a8(hidden_states.dtype, cap, quantize_activations)
    cfg = launch_config(num_pairs, cap, config, w8a8)
    aligned = moe_align_block_size(topk_ids, cfg.block_m, num_experts)
    gate_up = _new_output((num_pairs, two_inter), hidden_states.dtype, hidden_states.device)
    a, a_scale = quantize_rows(hidden_states, s13, w13_input_scale) if w8a8 else (hidden_states, None)
    grouped_fp8_gemm(a, w13_bits, s13, w13_bias, gate_up, None, aligned, top_k, cfg, a_scale)
    inter = expert_activation(gate_up, activation)
    a, a_scale = quantize_rows(inter, s2, w2_input_scale) if w8a8 else (inter, None)
    down = _new_output((num_pairs, hidden_size), torch.float32, hidden_states.device)
    grouped_fp8_gemm(a, w2_bits, s2, w2_bias, down, topk_weights.reshape(-1).float().contiguous(), aligned, 1,
                     cfg, a_scale)
    return moe_sum(down, top_k, hidden_states.dtype)  # float32 sum, one rounding, float16 clamped
