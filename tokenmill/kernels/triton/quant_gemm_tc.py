"""int4/int8 weight-only GEMM for batch-sized M on tensor cores (Triton): y = x @ dequantize(w)^T (+ bias).

For the rows where `quant_linear`'s other paths lose to bf16 (its module docstring): at M of a few hundred
rows its dequantize + cuBLAS path writes and re-reads the whole weight in x's dtype on every call (on the H200
a Llama-3.1-8B layer took 484 us at M = 512 against bf16's 301; `benchmarks/gpu/large_m_paths.py`), and its
tiled kernel, built for few rows, was 5x slower than bf16 there. This kernel is an output-tiled GEMM (one
program per [BLOCK_M, BLOCK_N] tile of y, grouped tile order for L2 reuse, software-pipelined K loop). With
operand "register" (`TcTiles`) it computes the transposed tile, y^T = W x^T, so that the unpacked weight is
the dot's first operand, which Hopper's wgmma reads from registers (x^T comes from shared memory, as in a bf16
GEMM); with "shared" it computes y = x W^T and the unpacked tile is stored to shared memory every K step:

    word  [BLOCK_N, BLOCK_K] int32 = qweight[n, k // p]           p = 32 // bits values per word (`quant_pack`)
    q     = (word >> (bits * (k % p))) & (2^bits - 1)
    W     = round_x((q - z[n, g]) * s[n, g])                      g = k0 // group_size, float32 math
    acc  += W [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]          tl.dot, float32 accumulator ("register"), or
    acc  += x [BLOCK_M, BLOCK_K] @ W^T                             ("shared")

Each column k of the tile indexes its own word, so no reshape of a [.., p] tensor is needed; the words reach
the tile either by loading word k // p per column ("index": p-fold repeated addresses, served by shared memory
through the cp.async pipeline) or by loading the packed [BLOCK_N, BLOCK_K / p] words and `tl.gather`-ing
word k // p ("gather": 16-byte loads, warp shuffles). q - z is formed exactly without an int -> float
conversion (the float32 bits 0x4B000000 | q are 2^23 + q; minus 2^23 + z). The weight is read once per row
tile of M, packed, and never written back; it is rounded once to x's dtype exactly as
`quant_pack.dequantize(..., dtype=x.dtype)`, so the result equals F.linear with the dequantized weight up to
summation order. Takes weights without act-order (`g_idx` None) whose group size is a multiple of BLOCK_K
(or -1), on compute capability >= 8.0 (Triton's tl.dot has no tensor cores on Volta, shared/PLATFORMS.md).
float16 outputs saturate at +-65504. float32 x multiplies in IEEE float32 (no TF32).

What the sm_90a compile shows (Triton 3.6, ptxas 12.8, bfloat16, 4-bit with zeros, unit strides specialized
as at launch; `ptxas -v`, TTGIR and SASS, no GPU):
  - the previous version (x @ W^T, W unpacked by reshape, 128 x 128 x 32, 8 warps): wgmma (HGMMA) with both
    operands in shared memory; the unpacked tile is stored there (local_alloc) every K step and the dot is
    followed by warp_group_dot_wait {pendings = 0}, so its tensor cores and its unpacking never overlap;
    210 registers leave one CTA per SM, so nothing else overlaps either; an I2F per weight element.
    64-deep K tiles spilled (168 bytes at 128 x 128). The reshape added no convert_layout at 128 x 128.
  - the formulation with per-column word indices but W as the second operand ([BLOCK_K, BLOCK_N]): the
    pipeliner stages the int32 word tile in shared memory (4x bf16's bytes) and it spilled 500-1800 bytes.
  - W as the register operand (this version): wgmma reads W from registers (converted into the dot's
    register layout through shared memory: STSM / LDSM). Triton splits each dot into K = 16 wgmmas; for
    most tiles ptxas then reports C7515 ("wgmma.mma_async instructions are serialized") and waits for each
    wgmma to finish (WARPGROUP.DEPBAR 0) before the next, so only other CTAs on the SM overlap the
    unpacking. "gather" reads its packed words conflict-free but got C7515 whenever a K step holds more
    than one wgmma. "index" loaded as [BLOCK_N, BLOCK_K] left the word tile N-major in shared memory with
    each warp reading 32 rows of one column (32-way bank conflicts, 16 LDS per thread per 32-deep step);
    loaded as [BLOCK_K, BLOCK_N] and transposed (as now) the 32- and 64-deep tiles that read it conflict-free
    (sizePerThread 8 along K) all got C7515 (e.g. 128 x 128 x 32, 8 warps: 127 registers, 2 CTAs per SM), and the tiles
    without C7515 (one wgmma kept in flight, DEPBAR 1: 64 x 128 x 32 with 8 warps, 128 x 64 x 32 with 4)
    got Triton's other layout, bank-conflicted, at 214-249 registers. BLOCK_K = 16 has one wgmma per step,
    waited for at once. A bf16 Triton GEMM at 128 x 128 x 64: 108 registers, four back-to-back HGMMAs per
    K step, one group in flight.
  - W in shared memory (operand "shared": y = x W^T, the previous version's structure without the reshape):
    back-to-back HGMMAs per K step like bf16's, no C7515, then a full wait (the staged tile is rewritten
    next step), so again only other CTAs overlap the unpacking; 128 x 128 x 32 with 8 warps at 128
    registers (2 CTAs per SM), 256 x 128 x 64 at 254; the tile is stored with one STS.U16 per element.
  - `tests/kernels/test_quant_compile_sm70.py` checks the planned tiles for spills (and reports C7515).

Status: still slow, so `quant_linear.TC_M_MAX` keeps it off. On the H200 (session 13, 8c3c49a,
`python benchmarks/gpu/large_m_paths.py`: 14 candidate tiles, each checked against dequantize + cuBLAS) the
best tile per M ran a Llama-3.1-8B layer at 0.21-0.22x of bf16 for M = 64..512 (128 x 64 x 64, 4 warps,
gather, W in shared memory) and 0.30-0.33x for M = 1024..4096 (256 x 128 x 64, 8 warps, gather, W as the
register operand), against 0.39-0.90x for dequantize + cuBLAS; every tile was slower than dequantize + cuBLAS
at every M. The previous version ran at 0.12-0.17x. What Triton cannot express here (an in-flight wgmma
beside conflict-free word reads, above) is the next thing to try, e.g. in Gluon with explicit layouts.
Register-operand wgmma has had a ptxas miscompile (inputs reused before the wgmma read them; reported for
CUDA 12.9's ptxas, Triton 3.6 assembles sm_90 with 12.8), so the benchmark checks every tile's output against
dequantize + cuBLAS and the GPU tests cover both operands at Llama sizes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenmill.kernels.quant_pack import QuantTensors, pack_factor
from tokenmill.kernels.triton.splitk import grouped_tile


class TcTiles(NamedTuple):
    """One launch configuration of `quant_gemm_tc_kernel`: output tile BLOCK_M x BLOCK_N, K tile BLOCK_K
    (columns; must divide the group size), warps, pipeline stages, and how the packed words reach the
    [BLOCK_N, BLOCK_K] tile: "index" (each column loads its own word k // p) or "gather" (16-byte loads of the
    packed words, tl.gather of word k // p per column), and where wgmma reads the unpacked tile: "register"
    (y^T = W x^T, W the register operand) or "shared" (y = x W^T, W stored to shared memory every K step);
    module docstring."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    unpack: str = "index"
    operand: str = "register"


# The tile table, by M: (largest M, TcTiles); BLOCK_K is lowered to divide the group size. A guess from the
# sm_90a compile (module docstring: conflict-free word reads; C7515, so overlap comes from 5 / 2 CTAs per SM),
# not yet timed: `benchmarks/gpu/large_m_paths.py` times candidates and prints a replacement for this table.
TC_TILES: tuple[tuple[int, TcTiles], ...] = (
    (128, TcTiles(64, 64, 32, 4, 4, "index")),
    (1 << 62, TcTiles(128, 128, 32, 8, 3, "index")),
)
UNPACK_MODES = ("gather", "index")
OPERANDS = ("register", "shared")
GROUP_M = 8


def tc_supported(w: QuantTensors, capability: tuple[int, int]) -> bool:
    """True when `quant_gemm_tc` takes `w` on a device of `capability`: cc >= 8.0, no act-order, and a group
    size of -1 or a multiple of 16 (the smallest K tile; BLOCK_K follows the group)."""
    g = w.group_size
    return tuple(capability) >= (8, 0) and w.g_idx is None and (g == -1 or (g >= 16 and g % 16 == 0))


def tc_tiles(m: int, group_size: int) -> TcTiles:
    """The TC_TILES entry for M rows, its BLOCK_K halved until it divides the weight's group size."""
    t = next(t for top, t in TC_TILES if m <= top)
    bk = t.block_k
    if group_size != -1:
        while group_size % bk:
            bk //= 2
    return t._replace(block_k=bk)


@triton.jit
def quant_gemm_tc_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr,
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qn, stride_qw, stride_sn, stride_sg, stride_zn, stride_zg, stride_om, stride_on,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMP_FP16: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, GATHER: tl.constexpr, W_IN_REGS: tl.constexpr,
):
    P: tl.constexpr = 32 // BITS
    pid_m, pid_n = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # W_IN_REGS: acc^T [BLOCK_N, BLOCK_M] += W @ x^T, x^T [BLOCK_K, BLOCK_M] the dot's shared-memory operand;
    # else acc [BLOCK_M, BLOCK_N] += x @ W^T with W staged in shared memory (TcTiles.operand).
    if W_IN_REGS:
        x_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None] * stride_xk
        x_mask = m_mask[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
        x_mask = m_mask[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    row_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * stride_qn  # [BLOCK_N, 1]
    col_ptrs = qw_ptr + offs_n[None, :].to(tl.int64) * stride_qn  # [1, BLOCK_N]
    offs_w = tl.arange(0, BLOCK_K // P)
    word_of_k = tl.broadcast_to((offs_k // P)[None, :], (BLOCK_N, BLOCK_K))
    shift = (offs_k[None, :] % P) * BITS
    num_words = tl.cdiv(K, P)
    s_ptrs = s_ptr + offs_n * stride_sn
    z_ptrs = z_ptr + offs_n * stride_zn
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if W_IN_REGS:
            x = tl.load(x_ptrs + k0 * stride_xk, mask=x_mask & ((k0 + offs_k) < K)[:, None], other=0.0)
        else:
            x = tl.load(x_ptrs + k0 * stride_xk, mask=x_mask & ((k0 + offs_k) < K)[None, :], other=0.0)
        if GATHER:
            wi = k0 // P + offs_w
            packed = tl.load(row_ptrs + wi[None, :] * stride_qw, mask=n_mask[:, None] & (wi < num_words)[None, :],
                             other=0)
            words = tl.gather(packed, word_of_k, axis=1)
        else:
            # Loaded as [BLOCK_K, BLOCK_N] and transposed: for most tiles Triton then stages the words K-major in
            # shared memory and reads them back without bank conflicts (as [BLOCK_N, BLOCK_K], each warp read
            # 32 rows of one column: 32-way conflicts; module docstring).
            wk = k0 // P + (offs_k // P)[:, None]
            words = tl.trans(tl.load(col_ptrs + wk * stride_qw, mask=n_mask[None, :] & (wk < num_words), other=0))
        g = k0 // group_size
        s = tl.load(s_ptrs + g * stride_sg, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(z_ptrs + g * stride_zg, mask=n_mask, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 1 << (BITS - 1), tl.float32)
        # 2^23 + q as float32 bits (exact), minus 2^23 + z: q - z exactly, without an int -> float conversion.
        q = (((words >> shift) & ((1 << BITS) - 1)) | 0x4B000000).to(tl.float32, bitcast=True)
        w = ((q - (z + 8388608.0)[:, None]) * s[:, None]).to(x.dtype)
        if W_IN_REGS:
            acc = tl.dot(w, x, acc, input_precision="ieee" if IEEE else None)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee" if IEEE else None)
    if W_IN_REGS:
        acc = tl.trans(acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if CLAMP_FP16:
        acc = tl.clamp(acc, -65504.0, 65504.0, propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as cuBLAS
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on,
             acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quant_gemm_tc(x: torch.Tensor, w: QuantTensors, bias: torch.Tensor | None = None,
                  tiles: TcTiles | tuple | None = None) -> torch.Tensor:
    """y [M, N] = x @ dequantize(w)^T (+ bias) with the unpacking tensor-core GEMM (module docstring).

    Args:
        x: [M, K] float16 / bfloat16 / float32, any strides (CUDA, or CPU under TRITON_INTERPRET=1).
        w: 4- or 8-bit weight in the `quant_pack` layout, no expert dim, no act-order, group size -1 or a
            multiple of 16 (`tc_supported`).
        bias: [N] or None.
        tiles: `TcTiles` (or a tuple of its fields; unpack defaults to "index") instead of `tc_tiles` (tests,
            sweeps); BLOCK_K must divide the group size (any K tile takes group -1: one group, k0 // K = 0).

    Returns:
        [M, N] in x's dtype; every element written.

    Raises:
        ValueError: x is not [M, K], the weight has act-order or a group size the K tiles cannot follow, or
            the unpack mode is unknown.
    """
    k = w.in_features
    n = w.qweight.shape[0]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for a quantized weight [{n}, {k}], not {tuple(x.shape)}.")
    if w.g_idx is not None:
        raise ValueError("quant_gemm_tc does not take act-order weights (g_idx); quant_linear plans another path.")
    group = k if w.group_size == -1 else w.group_size
    bm, bn, bk, warps, stages, unpack, operand = (TcTiles(*tiles) if tiles is not None
                                                   else tc_tiles(x.shape[0], w.group_size))
    if unpack not in UNPACK_MODES or operand not in OPERANDS:
        raise ValueError(f"unpack must be one of {UNPACK_MODES} and operand one of {OPERANDS}, not {unpack!r} "
                         f"and {operand!r}.")
    if (w.group_size != -1 and group % bk) or bk % pack_factor(w.bits) or bk < 16:
        raise ValueError(f"BLOCK_K {bk} must be >= 16, a multiple of {pack_factor(w.bits)} and divide the group "
                         f"size {group}.")
    m = x.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    z = w.qzeros
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    quant_gemm_tc_kernel[grid](
        x, w.qweight, w.scales, z if z is not None else w.scales, bias if bias is not None else out, out,
        m, n, k, group,
        x.stride(0), x.stride(1), w.qweight.stride(0), w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
        z.stride(0) if z is not None else 0, z.stride(1) if z is not None else 0, out.stride(0), out.stride(1),
        BITS=w.bits, HAS_ZEROS=z is not None, HAS_BIAS=bias is not None, CLAMP_FP16=x.dtype == torch.float16,
        IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=GROUP_M, NUM_STAGES=stages,
        GATHER=unpack == "gather", W_IN_REGS=operand == "register", num_warps=warps,
    )
    return out
