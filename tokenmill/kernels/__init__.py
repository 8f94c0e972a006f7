"""Every kernel of tokenmill, one Python entry point per op.

    kernels/triton/   Triton kernels (CUDA; tests run them under TRITON_INTERPRET=1)
    kernels/cpu/      C kernels for the CPU with their build code (`cpu/build.py`)

Entry points (layers and attention backends call these, never a kernel module):

    op                   CUDA (Triton)                      CPU (C)
    rms_norm             triton/rms_norm.py                 cpu/elementwise.py
    silu_and_mul         triton/activation.py               cpu/elementwise.py
    gelu_and_mul         triton/activation.py               -
    rotary_embedding     triton/rotary.py                   cpu/elementwise.py (neox, full rotary dim)
    reshape_and_cache    triton/reshape_and_cache.py        -
    paged_attention      triton/paged_attention_launch.py   -
    fused_experts        triton/fused_moe.py                -
    quant_linear         triton/quant_linear.py             - (weights dequantized at load)
    dequantize_weight    triton/quant_linear.py             quant_pack.py (PyTorch)
    fused_experts_quant  triton/fused_moe_quant.py          -
    fused_experts_mxfp4  triton/fused_moe_mxfp4.py          - (experts dequantized at load)
    fused_experts_fp8    triton/fused_moe_fp8.py            - (experts dequantized at load)
    fp8_linear           triton/fp8_gemm.py (_scaled_mm)    fp8.py (PyTorch reference, no FP8 arithmetic)
    quantize_fp8_activations  triton/fp8_quant.py           fp8.py (PyTorch, bit-equal)
    dequantize_fp8_weight     triton/fp8_gemm.py            fp8.py (PyTorch, table decode)
    dequantize_mxfp4     triton/mxfp4_dequant.py            mxfp4.py (PyTorch)

Paged attention: the kernel in `triton/paged_attention.py`, its host launcher in `triton/paged_attention_launch.py`.
int4/int8 weight-only layout: `quant_pack.py` (one layout, PyTorch pack/unpack/dequantize reference).
FP8 (e4m3fn) schemes, scales and references: `fp8.py` (`Fp8Weight`).
fp8 KV cache (e4m3fn / e5m2, per-layer k_scale / v_scale): `kv_fp8.py` (PyTorch rule and CPU path),
    `triton/kv_fp8.py` (bit encode / decode inside reshape_and_cache and paged_attention).
    CPU decode attention -                                  cpu/decode.py (`kernels.cpu.decode`)

The elementwise entry points return None where no kernel takes the inputs
(another device, dtype or layout; Triton missing or turned off; no C
compiler): the caller then runs its PyTorch code, which is the numerical
reference the kernels reproduce (see each kernel module for the roundings).

On CUDA each elementwise layer is one kernel launch instead of the 2-16 small
PyTorch kernels of its reference code. Env `TOKENMILL_DISABLE_FUSED_KERNELS=1`
keeps the PyTorch path on CUDA too (for bisecting a numerical difference, or
a Triton that does not work on the machine); it is read once per process, at
the first CUDA forward.

This module does not import triton (the Triton modules are imported at their
first call), so CPU runs never load it and tests can set TRITON_INTERPRET
before its first import.
"""

from __future__ import annotations

import functools
import logging

import torch

from tokenmill import envs
from tokenmill.kernels.cpu import elementwise as _cpu
from tokenmill.kernels.fp8 import (
    Fp8Weight,
    fp8_linear_reference,
    quantize_fp8_per_group,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from tokenmill.kernels.fp8 import dequantize_fp8_weight as _fp8_dequantize
from tokenmill.kernels.quant_pack import QuantTensors, dequantize

logger = logging.getLogger(__name__)

# Dtypes of the fused Triton elementwise kernels (triton/numerics.py FUSED_DTYPES), spelled out here so that
# a CPU import does not load triton.
_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def use_fused_kernels(x: torch.Tensor) -> bool:
    """True when `x` is a CUDA tensor and the fused Triton kernels are enabled and importable.

    Cheap enough for every forward: one attribute read, then a cached answer.
    """
    return x.is_cuda and _fused_kernels_available()


@functools.cache
def _fused_kernels_available() -> bool:
    if envs.disable_fused_kernels():
        logger.info("TOKENMILL_DISABLE_FUSED_KERNELS is set: RMSNorm, RoPE, gated activations and MoE routing "
                    "run as PyTorch ops on CUDA")
        return False
    try:
        import triton  # noqa: F401
    except (ImportError, OSError, RuntimeError) as e:  # missing, or fails to initialise on this machine
        logger.warning("Triton cannot be imported (%s): RMSNorm, RoPE and gated activations run as "
                       "PyTorch ops on CUDA (slower decode steps)", e)
        return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """RMSNorm of x [..., n] (optionally after adding `residual`) in one kernel; None where no kernel applies.

    Returns the normed x (residual None) or (RMSNorm(x + residual), x + residual), new tensors of x's dtype,
    rounded as `RMSNorm.forward_torch`. CUDA: Triton, float32/float16/bfloat16. CPU: C, float32/bfloat16,
    weight in x's dtype.
    """
    if use_fused_kernels(x):
        from tokenmill.kernels.triton import rms_norm as ops

        if ops.rms_norm_supported(x, weight, gemma):
            if residual is None:
                return ops.rms_norm(x, weight, eps, gemma)
            if residual.shape == x.shape and residual.dtype == x.dtype:
                return ops.fused_add_rms_norm(x, residual, weight, eps, gemma)
        return None
    if (x.device.type == "cpu" and weight.dtype == x.dtype and _cpu.supports(x)
            and (lib := _cpu.load()) is not None):
        if residual is None:
            return _cpu.rms_norm(lib, x, weight, eps, gemma)
        if residual.shape == x.shape and residual.dtype == x.dtype and _cpu.supports(residual):
            return _cpu.rms_norm(lib, x, weight, eps, gemma, residual)
    return None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d] in one kernel (CUDA or CPU); None where no kernel applies."""
    if use_fused_kernels(x):
        if x.dtype not in _FUSED_DTYPES:
            return None
        from tokenmill.kernels.triton.activation import silu_and_mul as triton_silu_and_mul

        return triton_silu_and_mul(x)
    if (x.device.type == "cpu" and _cpu.supports(x) and x.shape[-1] % 2 == 0
            and (lib := _cpu.load()) is not None):
        return _cpu.silu_and_mul(lib, x)
    return None


def gelu_and_mul(x: torch.Tensor, approximate: str = "tanh") -> torch.Tensor | None:
    """gelu(x[..., :d]) * x[..., d:] for x [..., 2d] ("tanh" or "none") in one Triton kernel on CUDA; else None."""
    if use_fused_kernels(x) and x.dtype in _FUSED_DTYPES:
        from tokenmill.kernels.triton.activation import gelu_and_mul as triton_gelu_and_mul

        return triton_gelu_and_mul(x, approximate)
    return None


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE of query and key (positions [T]; cos/sin_cache [max_position, rotary_dim // 2] float32) in one
    kernel; returns new (query, key) shaped like the inputs, or None where no kernel applies.

    CUDA: Triton, any style and rotary dim. CPU: C, neox style with rotary_dim == head_size only.
    """
    if use_fused_kernels(query):
        from tokenmill.kernels.triton import rotary as ops

        if ops.rotary_supported(query, key, head_size):
            return ops.rotary_embedding(positions, query, key, cos_cache, sin_cache, head_size, rotary_dim,
                                        is_neox_style)
        return None
    if (query.device.type == "cpu" and is_neox_style and rotary_dim == head_size
            and _cpu.rope_supports(positions, query, key, cos_cache, sin_cache)
            and (lib := _cpu.load()) is not None):
        return _cpu.rotary_neox(lib, positions, query, key, cos_cache, sin_cache)
    return None


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T]
    (slot -1 skipped), in place, with the Triton kernel (`kernels.triton.reshape_and_cache`); an fp8
    cache stores key / k_scale and value / v_scale rounded to fp8 (`kernels/kv_fp8.py`)."""
    from tokenmill.kernels.triton.reshape_and_cache import reshape_and_cache as triton_reshape_and_cache

    triton_reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, **options) -> torch.Tensor:
    """Varlen attention of mixed prefill chunks and decodes over the paged KV cache, Triton.

    Arguments and keyword options (num_reqs, max_query_len, scale, sliding_window, logits_soft_cap, out,
    max_seq_len, sinks, k_scale / v_scale of an fp8 cache, launch settings) as
    `kernels.triton.paged_attention_launch.paged_attention`; returns [T, H, D].
    """
    from tokenmill.kernels.triton.paged_attention_launch import paged_attention as triton_paged_attention

    return triton_paged_attention(query, kv_cache, block_table, seq_lens, query_start_loc, **options)


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k routed gated-MLP experts with Triton grouped GEMMs (CUDA): hidden [T, H], w13 [E, 2I, H],
    w2 [E, H, I], topk_weights / topk_ids [T, k], optional biases w13_bias [E, 2I] / w2_bias [E, H]
    -> [T, H] (`kernels.triton.fused_moe.fused_experts_triton`)."""
    from tokenmill.kernels.triton.fused_moe import fused_experts_triton

    return fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids, activation,
                                w13_bias=w13_bias, w2_bias=w2_bias)


def quant_linear(x: torch.Tensor, w: QuantTensors, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ dequantize(w)^T (+ bias) for int4/int8 weight-only `w` (`quant_pack` layout), CUDA.

    x [M, K] float16 / bfloat16 / float32 -> [M, N] in x's dtype. Picks split-K Triton for small M, a
    tiled Triton GEMM for medium M, dequantize-then-cuBLAS for large M (and for M > small on cc < 8.0,
    where `tl.dot` has no tensor cores): `kernels.triton.quant_linear.quant_linear`.
    """
    from tokenmill.kernels.triton.quant_linear import quant_linear as triton_quant_linear

    return triton_quant_linear(x, w, bias)


def dequantize_weight(w: QuantTensors, dtype: torch.dtype) -> torch.Tensor:
    """The dense [(E,) N, K] weight of `w` in `dtype`: Triton on CUDA, `quant_pack.dequantize` elsewhere."""
    if w.qweight.is_cuda:
        from tokenmill.kernels.triton.quant_linear import dequantize_weight as triton_dequantize

        return triton_dequantize(w, dtype)
    return dequantize(w.qweight, w.scales, w.qzeros, w.g_idx, w.bits, w.group_size, w.in_features, dtype)


def fused_experts_quant(hidden_states: torch.Tensor, w13: QuantTensors, w2: QuantTensors,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """`fused_experts` with int4/int8 expert weights (`quant_pack` layout, leading expert dim), CUDA:
    hidden [T, H], w13 [E, 2I, H] logical, w2 [E, H, I] logical, topk [T, k] -> [T, H]."""
    from tokenmill.kernels.triton.fused_moe_quant import fused_experts_quant_triton

    return fused_experts_quant_triton(hidden_states, w13, w2, topk_weights, topk_ids, activation)


def fused_experts_mxfp4(hidden_states: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor,
                        w2_blocks: torch.Tensor, w2_scales: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: str = "swigluoai", w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_experts` with MXFP4 expert weights decoded inside the grouped GEMMs, CUDA: hidden [T, H],
    w13 blocks [E, 2I, H / 32, 16] / scales [E, 2I, H / 32] uint8, w2 blocks [E, H, I / 32, 16] / scales
    [E, H, I / 32], topk [T, k], optional biases [E, 2I] / [E, H] -> [T, H]
    (`kernels.triton.fused_moe_mxfp4.fused_experts_mxfp4_triton`)."""
    from tokenmill.kernels.triton.fused_moe_mxfp4 import fused_experts_mxfp4_triton

    return fused_experts_mxfp4_triton(hidden_states, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights,
                                      topk_ids, activation, w13_bias=w13_bias, w2_bias=w2_bias)


def fused_experts_fp8(hidden_states: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      activation: str = "silu", w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
                      quantize_activations: bool = True) -> torch.Tensor:
    """`fused_experts` with FP8 e4m3 expert weights, CUDA: hidden [T, H], w13 [E, 2I, H] / w2 [E, H, I]
    float8_e4m3fn, float32 scales per expert [E], per channel [E, N] or with block_size (Bn, Bk)
    [E, ceil(N / Bn), ceil(K / Bk)], topk [T, k], optional biases [E, 2I] / [E, H] -> [T, H]. W8A8 (activations
    quantized per token, per 1 x Bk group with block scales) when quantize_activations, cc >= 8.9 and 16-bit
    activations, else weight-only, the e4m3 bytes decoded in the grouped GEMMs
    (`kernels.triton.fused_moe_fp8.fused_experts_fp8_triton`)."""
    from tokenmill.kernels.triton.fused_moe_fp8 import fused_experts_fp8_triton

    return fused_experts_fp8_triton(hidden_states, w13, w13_scale, w2, w2_scale, topk_weights, topk_ids, activation,
                                    w13_bias=w13_bias, w2_bias=w2_bias, block_size=block_size,
                                    quantize_activations=quantize_activations)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None,
               quantize_activations: bool = True) -> torch.Tensor:
    """y = x @ W^T (+ bias) for an FP8 weight `w` (per-tensor, per-channel or block scales; `kernels.fp8`).

    x [..., K] float16 / bfloat16 / float32 -> [..., N] in x's dtype. quantize_activations: W8A8 (x
    quantized per token, per 1 x Bk group for block weights, or with w.input_scale), else weight-only.
    CUDA: `kernels.triton.fp8_gemm.fp8_linear_triton` (W8A8 on cc >= 8.9 via torch._scaled_mm or Triton;
    below 8.9 always weight-only, decoding the fp8 bits in the kernel). Elsewhere (CPU):
    `fp8.fp8_linear_reference` (dequantize, float32 matmul; x quantized first for W8A8).

    Raises:
        ValueError: x's last dim is not K, or w's scale / block size does not fit its weight.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from tokenmill.kernels.triton.fp8_gemm import fp8_linear_triton

        y = fp8_linear_triton(x2, w, bias, quantize_activations)
    else:
        if x2.shape[1] != w.weight.shape[-1]:
            raise ValueError(f"x must end in {w.weight.shape[-1]} features for this FP8 weight, not {x.shape[-1]}.")
        y = fp8_linear_reference(x2, w, bias, quantize_activations)
    return y.reshape(*lead, y.shape[-1])


def quantize_fp8_activations(x: torch.Tensor, group_size: int | None = None,
                             scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of x [M, K]: (q float8_e4m3fn [M, K], scale float32 [M, 1] per token or
    [M, ceil(K / group_size)] per group); a static `scale` ([] / [1]) is used as given (returned as [1]).
    CUDA: one Triton launch (`kernels.triton.fp8_quant`); elsewhere `kernels.fp8` (bit-equal)."""
    if x.is_cuda:
        from tokenmill.kernels.triton.fp8_quant import quantize_fp8_triton

        return quantize_fp8_triton(x, group_size, scale)
    if scale is not None:
        q, s = quantize_fp8_per_tensor(x, scale)
        return q, s.reshape(1)
    return quantize_fp8_per_row(x) if group_size is None else quantize_fp8_per_group(x, group_size)


def dequantize_fp8_weight(w: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [N, K] weight of `w` in `dtype` (q * scale in float32, rounded once): Triton on CUDA,
    `fp8.dequantize_fp8_weight` (table decode, no FP8 arithmetic) elsewhere."""
    if w.weight.is_cuda:
        from tokenmill.kernels.triton.fp8_gemm import dequantize_fp8_triton

        return dequantize_fp8_triton(w, dtype)
    return _fp8_dequantize(w, dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 + scales [..., G] uint8 -> [..., G * 32] `dtype` (`kernels/mxfp4.py`
    layout): one Triton launch on CUDA (`triton/mxfp4_dequant.py`), PyTorch elsewhere; same values."""
    if blocks.is_cuda:
        from tokenmill.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

        return dequantize_mxfp4_triton(blocks, scales, dtype)
    from tokenmill.kernels.mxfp4 import dequantize_mxfp4 as torch_dequantize_mxfp4

    return torch_dequantize_mxfp4(blocks, scales, dtype)
