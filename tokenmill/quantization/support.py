"""Which quantized checkpoints run on which device, and through which kernel (one table, for start-up, `tokenmill env`
and docs/quantization.md).

Every method is converted at load into one layout (tokenmill/kernels/quant_pack.py), so support depends on the
device, not on the method:

- CUDA, compute capability >= 8.0: Triton kernels read the packed weights: split-K for small batches (decode reads
  about a quarter of the 16-bit bytes), a tiled dequantize-in-the-loop GEMM for medium ones, dequantize + cuBLAS for
  large ones; the fused-MoE experts use the quantized Triton fused-MoE kernel.
- CUDA, compute capability 7.x (V100, T4): `tl.dot` has no tensor cores on Volta, so only small batches use the
  split-K kernel; larger ones dequantize a layer's weight and use cuBLAS in float16, accumulating in float32.
- CPU: weights are dequantized into the model's weight dtype at load; memory is that of the 16/32-bit model.
- CUDA below 7.0 and other devices: refused at start-up.

FP8 weights (`fp8` checkpoints, compressed-tensors float-quantized, `--quantization fp8`; row "fp8") keep their
e4m3 bytes on the GPU and run through `kernels.fp8_linear` (kernels/triton/fp8_gemm.py):

- cc >= 8.9 (Ada, Hopper): W8A8 as the checkpoint says: activations quantized per token (per 1 x 128 group for
  block weights, or with the static input_scale), then the Triton FP8 GEMM for decode-sized batches (M <= 16) and
  block scales or float16, `torch._scaled_mm` (per-channel, bfloat16) above; weight-only checkpoints decode the
  weight in the Triton GEMM.
- cc 8.0 - 8.8 (Ampere) and cc 7.x (V100, T4: no FP8 arithmetic): weight-only at every checkpoint's scheme (a
  W8A8 checkpoint's activations stay 16-bit): the Triton GEMM decodes the e4m3 bits to float16 with integer
  ops; cc 7.x multiplies small batches with float32 FMAs and larger ones through dequantize + cuBLAS.
- MoE experts (kernels/triton/fused_moe_fp8.py): on cc >= 8.9 with 16-bit activations and a checkpoint that
  quantizes activations, the W8A8 Triton grouped GEMM (fp8 dots; the MoE input per token or per 1 x 128 group,
  the activated rows again); otherwise the grouped GEMM decoding the routed experts' e4m3 bytes in the kernel
  (weight-only).
- CPU: dequantized into the weight dtype at load.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.quantization.config import METHODS, QuantizationConfig

MIN_CUDA_CAPABILITY = (7, 0)

_CC80 = ("Triton FMA GEMV (M = 1), Triton tensor-core GEMV with PTX dequantization (M <= 64; 4-bit, no act-order), "
         "Triton split-K (small M) / tiled dequantize-in-loop GEMM (medium M) for the other weights, "
         "dequantize + cuBLAS (large M); MoE: Triton fused-MoE with quantized experts")
_CC70 = ("Triton FMA GEMV (M = 1), dequantize + cuBLAS float16 with float32 accumulation (larger M); "
         "MoE: the quantized Triton grouped fused-MoE kernel at every M (float32 FMAs, no tensor cores)")
_CPU = "dequantized into the weight dtype at load, then the CPU path (16/32-bit weights in memory)"


_FP8_CC89 = ("W8A8 as the checkpoint says (activations per token, per 1 x 128 group or static): the Triton FP8 GEMM "
             "(M <= 16, block scales, float16) or torch._scaled_mm (per-channel, bfloat16, M > 16); weight-only "
             "checkpoints: Triton GEMM decoding e4m3 in the kernel; MoE: weight-only Triton FP8 grouped GEMM "
             "decoding e4m3 in the kernel (its W8A8 fp8-dot mode is built, off until measured on a GPU)")
_FP8_CC80 = ("weight-only (W8A8 checkpoints keep 16-bit activations: no FP8 arithmetic before cc 8.9): Triton GEMM "
             "decoding e4m3 in the kernel (split-K small M, tiled medium M), dequantize + cuBLAS (large M); MoE: "
             "Triton FP8 grouped GEMM decoding e4m3 in the kernel")
_FP8_CC70 = ("weight-only via e4m3 -> float16 bit decoding (no FP8 arithmetic): Triton split-K with float32 FMAs "
             "(small M), dequantize + cuBLAS float16 with float32 accumulation (larger M); MoE: the Triton FP8 grouped "
             "GEMM with the same bit decoding (float32 FMAs, no tensor cores)")
_REFUSED = "refused: tokenmill's Triton kernels need compute capability 7.0 or newer"
FP8_ROW = "fp8"  # the table's row for every FP8 format (fp8, compressed-tensors float-quantized, --quantization fp8)


@dataclass(frozen=True)
class SupportRow:
    """One line of the method x device table."""

    method: str  # "awq" | "gptq" | "compressed-tensors" (int4/int8) | "fp8" (every FP8 format)
    device: str  # int4/int8: "cuda cc >= 8.0" | "cuda cc 7.x"; fp8: "cuda cc >= 8.9" | "cuda cc 8.0-8.8" |
    #              "cuda cc 7.x"; all: "cpu" | "cuda cc < 7.0"
    bits: tuple[int, ...]  # weight bits read
    kernel: str  # how it runs there, or "refused: <why>"


def _bits(method: str) -> tuple[int, ...]:
    return (4,) if method == "awq" else (8,) if method == FP8_ROW else (4, 8)


def support_table() -> list[SupportRow]:
    """Every (method, device) pair with its kernel, in display order (methods x devices)."""
    rows = []
    for method in (m for m in METHODS if m != FP8_ROW):
        rows += [SupportRow(method, "cuda cc >= 8.0", _bits(method), _CC80),
                 SupportRow(method, "cuda cc 7.x", _bits(method), _CC70),
                 SupportRow(method, "cpu", _bits(method), _CPU),
                 SupportRow(method, "cuda cc < 7.0", _bits(method), _REFUSED)]
    rows += [SupportRow(FP8_ROW, "cuda cc >= 8.9", (8,), _FP8_CC89),
             SupportRow(FP8_ROW, "cuda cc 8.0-8.8", (8,), _FP8_CC80),
             SupportRow(FP8_ROW, "cuda cc 7.x", (8,), _FP8_CC70),
             SupportRow(FP8_ROW, "cpu", (8,), _CPU),
             SupportRow(FP8_ROW, "cuda cc < 7.0", (8,), _REFUSED)]
    return rows


def device_label(method: str, device_type: str, capability: tuple[int, int] | None) -> str:
    """The `SupportRow.device` of `method`'s row for this device ("cpu" for anything but CUDA)."""
    if device_type != "cuda":
        return "cpu"
    cc = tuple(capability)
    if cc < (7, 0):
        return "cuda cc < 7.0"
    if cc < (8, 0):
        return "cuda cc 7.x"
    if method != FP8_ROW:
        return "cuda cc >= 8.0"
    return "cuda cc >= 8.9" if cc >= (8, 9) else "cuda cc 8.0-8.8"


def rows_for(device_type: str, capability: tuple[int, int] | None) -> list[SupportRow]:
    """One row per method for this device (`tokenmill env`)."""
    return [r for r in support_table() if r.device == device_label(r.method, device_type, capability)]


def kernel_for(cfg: QuantizationConfig, device_type: str, capability: tuple[int, int] | None) -> str:
    """The kernel description `check_supported` accepts for this device (see `support_table`)."""
    check_supported(cfg, device_type, capability)
    method = FP8_ROW if cfg.is_fp8 else cfg.method
    label = device_label(method, device_type, capability)
    return next(r.kernel for r in support_table() if r.method == method and r.device == label)


def check_supported(cfg: QuantizationConfig, device_type: str, capability: tuple[int, int] | None) -> None:
    """Refuse, at start-up, a quantized checkpoint the device cannot run.

    Args:
        cfg: the parsed quantization config.
        device_type: torch's device type ("cuda" or "cpu").
        capability: (major, minor) compute capability for CUDA, None for CPU.

    Raises:
        ValueError: one sentence naming the device, the method and what
            would work there (a newer GPU or the CPU).
    """
    what = f"{cfg.method} FP8" if cfg.is_fp8 else f"{cfg.method} {cfg.bits}-bit"
    if device_type == "cpu":
        return
    if device_type != "cuda":
        raise ValueError(f"{what} quantized weights are not supported on device {device_type!r}; tokenmill runs "
                         "them on NVIDIA GPUs of compute capability 7.0 or newer and on the CPU.")
    if capability is None:
        raise ValueError(f"{what} quantized weights on CUDA need the GPU's compute capability, which is unknown; "
                         "they run on compute capability 7.0 or newer and on the CPU.")
    if tuple(capability) < MIN_CUDA_CAPABILITY:
        cc = f"{capability[0]}.{capability[1]}"
        raise ValueError(f"{what} quantized weights cannot run on this GPU of compute capability {cc}: tokenmill's "
                         "Triton kernels need compute capability 7.0 or newer (V100, T4, A100, H100, ...); "
                         "use such a GPU, or --device cpu, where the weights are dequantized at load.")
