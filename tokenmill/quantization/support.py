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
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.quantization.config import METHODS, QuantizationConfig

MIN_CUDA_CAPABILITY = (7, 0)

_CC80 = ("Triton FMA GEMV (M <= 2), Triton split-K (small M), Triton tiled dequantize-in-loop GEMM (medium M), dequantize + cuBLAS "
         "(large M); MoE: Triton fused-MoE with quantized experts")
_CC70 = ("Triton FMA GEMV (M = 1), dequantize + cuBLAS float16 with float32 accumulation (larger M); "
         "MoE: the quantized Triton grouped fused-MoE kernel at every M (float32 FMAs, no tensor cores)")
_CPU = "dequantized into the weight dtype at load, then the CPU path (16/32-bit weights in memory)"


@dataclass(frozen=True)
class SupportRow:
    """One line of the method x device table."""

    method: str  # "awq" | "gptq" | "compressed-tensors"
    device: str  # "cuda cc >= 8.0" | "cuda cc 7.x" | "cpu" | "cuda cc < 7.0"
    bits: tuple[int, ...]  # weight bits read
    kernel: str  # how it runs there, or "refused: <why>"


def _bits(method: str) -> tuple[int, ...]:
    return (4,) if method == "awq" else (4, 8)


def support_table() -> list[SupportRow]:
    """Every (method, device) pair with its kernel, in display order (methods x devices)."""
    rows = []
    for method in METHODS:
        rows += [SupportRow(method, "cuda cc >= 8.0", _bits(method), _CC80),
                 SupportRow(method, "cuda cc 7.x", _bits(method), _CC70),
                 SupportRow(method, "cpu", _bits(method), _CPU),
                 SupportRow(method, "cuda cc < 7.0", _bits(method),
                            "refused: tokenmill's Triton kernels need compute capability 7.0 or newer")]
    return rows


def kernel_for(cfg: QuantizationConfig, device_type: str, capability: tuple[int, int] | None) -> str:
    """The kernel description `check_supported` accepts for this device (see `support_table`)."""
    check_supported(cfg, device_type, capability)
    if device_type == "cpu":
        return _CPU
    return _CC80 if capability >= (8, 0) else _CC70


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
    what = f"{cfg.method} {cfg.bits}-bit"
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
