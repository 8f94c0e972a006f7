"""A linear layer's weight kept in GGUF's quantized blocks on the CPU (`LinearBase.matmul` dispatches on it).

A fused layer (q/k/v, gate/up) is built from several GGUF tensors that may
use different types (Q4_K_M files store some v and down projections as
Q6_K), so the weight is a list of segments, each a run of output rows of
one type:

    out features:  | q (Q4_K) | k (Q4_K) | v (Q6_K) |
    segments:      | rows [0, q+k), Q4_K  | rows [q+k, out), Q6_K |

Each segment is a contiguous uint8 tensor [rows, row_bytes] of ggml blocks
(layouts: `kernels/cpu/gguf_matmul.c`), multiplied by the C kernel straight
into its columns of the output. Batches above `KERNEL_MAX_TOKENS` tokens
(prefill) dequantize the weight into x's dtype and call `F.linear` instead:
there the BLAS matmul beats the kernel, whose per-token cost stays ~2 FMAs
per weight (SmolLM2's 3072 x 576 gate/up, one thread: kernel 0.19 ms at 1
token, 1.2 ms at 16, 4.8 ms at 64; dequantize + float32 `F.linear` 0.39 /
1.29 / 2.96 ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.kernels.cpu import gguf_matmul

# Up to this many tokens per call run in the C kernel; more dequantize the weight for the BLAS matmul.
KERNEL_MAX_TOKENS = 8


@dataclass(slots=True)
class GGUFSegment:
    """Output rows [start, start + blocks.shape[0]) of a weight, stored as GGUF blocks of one type."""

    start: int  # first output row (feature) of this segment
    qtype: str  # ggml type name, a key of kernels/cpu/gguf_matmul.KERNEL_BLOCKS
    blocks: torch.Tensor  # [rows, row_bytes] uint8, contiguous, CPU


class GGUFWeight:
    """Weight [out_features, in_features] as GGUF block segments (see the module docstring); CPU only.

    Raises:
        ValueError: the segments do not tile rows [0, out_features) in order, or the C kernel is unavailable.
    """

    def __init__(self, segments: list[GGUFSegment], out_features: int, in_features: int) -> None:
        lib = gguf_matmul.load()
        if lib is None:
            raise ValueError("GGUF weights stay quantized only with the CPU C kernels (a C compiler and "
                             "TOKENMILL_CPU_KERNELS=1); set TOKENMILL_CPU_GGUF_KERNELS=0 to dequantize at load.")
        row = 0
        for seg in segments:
            if seg.start != row:
                raise ValueError(f"GGUF weight segments must tile the output rows in order; row {row} is followed "
                                 f"by a segment at {seg.start}")
            row += seg.blocks.shape[0]
        if row != out_features:
            raise ValueError(f"GGUF weight segments cover {row} of {out_features} output rows")
        for seg in segments:  # validated once here, so matmul calls the kernel without re-checking
            gguf_matmul.check_blocks(seg.blocks, seg.qtype, in_features)
        self._lib = lib
        self.segments = segments
        self.shape = torch.Size((out_features, in_features))
        # per segment: (blocks pointer, row bytes, ggml type id, rows, first row); the tensors stay in `segments`
        self._calls = [(seg.blocks.data_ptr(), seg.blocks.shape[1], gguf_matmul.KERNEL_BLOCKS[seg.qtype][0],
                        seg.blocks.shape[0], seg.start) for seg in segments]

    @property
    def nbytes(self) -> int:
        """Bytes of block data held."""
        return sum(seg.blocks.numel() for seg in self.segments)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a new [out_features, in_features] tensor of `dtype` (`gguf.quants.dequantize`'s values,
        rounded once to `dtype`)."""
        k = self.shape[1]
        parts = [gguf_matmul.dequantize(self._lib, seg.blocks, seg.qtype, k) for seg in self.segments]
        w = parts[0] if len(parts) == 1 else torch.cat(parts)
        return w if dtype == torch.float32 else w.to(dtype)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in_features] float32/bfloat16 (CPU) @ weight^T (+ bias) -> [..., out_features] of x's dtype."""
        k = self.shape[1]
        x2 = x.reshape(-1, k)
        if x2.shape[0] > KERNEL_MAX_TOKENS or x.dtype not in gguf_matmul.DTYPES:
            return F.linear(x, self.dequantize(x.dtype), bias)
        if x2.stride(1) != 1 or x.device.type != "cpu":
            x2 = x2.contiguous().cpu()
        num_tokens, n = x2.shape[0], self.shape[0]
        out = torch.empty(num_tokens, n, dtype=x.dtype)
        # the decode hot path (~120 calls a step for SmolLM2): straight to C, shapes checked at construction
        is_bf16, threads, out_ptr = int(x.dtype == torch.bfloat16), torch.get_num_threads(), out.data_ptr()
        for ptr, nbytes, type_id, rows, start in self._calls:
            rc = self._lib.gguf_matmul(ptr, nbytes, type_id, rows, k, x2.data_ptr(), x2.stride(0), num_tokens,
                                       out_ptr + start * out.element_size(), n, is_bf16, threads)
            if rc != 0:
                raise ValueError(f"gguf_matmul failed ({rc}) on a [{rows}, {k}] segment")
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], self.shape[0])
