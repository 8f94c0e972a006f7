"""Matmul and dequantization of GGUF-quantized weights on CPU in C (`gguf_matmul.c`).

The weight stays in ggml's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K; layouts in
the C file's header and `KERNEL_BLOCKS` below, the one table of them; the
GGUF loader's NumPy dequantization `model_loader/gguf_dequant.py` reads it too) and is
dequantized 32 weights at a time inside the dot product, so a decode step
reads 4.5-8.5 bits per weight instead of 32 (float32) or 16 (bfloat16).
The dequantized weights are the `gguf` package's reference bits
(`gguf.quants.dequantize`); products differ from a float32 matmul of them
only in the summation order (float32 sums) and, with AVX-512, in where each
32-weight chunk's scale and offset apply: d * (q . x) + m * sum(x) instead of
(d * q + m) . x (same value in exact arithmetic, other float32 roundings).

Built by `build.py` (system C compiler, cached per machine); without it, or
with `TOKENMILL_CPU_KERNELS=0`, `load()` returns None and the caller
dequantizes with NumPy instead (`layers/gguf_weights.py`).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.kernels.cpu.build import load_library

_SOURCE = Path(__file__).with_name("gguf_matmul.c")
DTYPES = (torch.float32, torch.bfloat16)

# ggml type name -> (ggml_type id, weights per block, bytes per block) of the types the CPU kernels
# (`gguf_matmul.c`) keep quantized; ggml-common.h's block_q4_0, block_q4_1, block_q5_0, block_q5_1, block_q8_0
# (32 weights) and block_q4_K, block_q6_K (256-weight superblocks; layouts in the C file's header).
KERNEL_BLOCKS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q5_0": (6, 32, 22),
    "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q6_K": (14, 256, 210),
}


def row_bytes(qtype_name: str, row_len: int) -> int:
    """Bytes of one row of `row_len` weights in a `KERNEL_BLOCKS` type.

    Raises:
        ValueError: another type, or `row_len` is not a whole number of blocks.
    """
    if qtype_name not in KERNEL_BLOCKS:
        raise ValueError(f"GGUF type {qtype_name} is not one the CPU kernels keep quantized ({sorted(KERNEL_BLOCKS)}).")
    _, per_block, nbytes = KERNEL_BLOCKS[qtype_name]
    if row_len % per_block:
        raise ValueError(f"A {qtype_name} row of {row_len} weights is not a whole number of {per_block}-weight blocks.")
    return row_len // per_block * nbytes


def _configure(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.gguf_matmul.argtypes = [ptr, i64, c_int, i64, i64, ptr, i64, i64, ptr, i64, c_int, c_int]
    lib.gguf_matmul.restype = c_int
    lib.gguf_dequantize.argtypes = [ptr, i64, c_int, i64, i64, ptr, i64, c_int]
    lib.gguf_dequantize.restype = c_int


def load() -> ctypes.CDLL | None:
    """The compiled library (built on the first call, see `build.py`); None when unavailable."""
    return load_library(_SOURCE, _configure)


def check_blocks(blocks: torch.Tensor, qtype: str, k: int) -> None:
    """Raises ValueError unless `blocks` is a contiguous CPU uint8 [rows, row_bytes(qtype, k)] tensor."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.device.type != "cpu" or not blocks.is_contiguous():
        raise ValueError(f"blocks must be a contiguous CPU uint8 [rows, row_bytes] tensor, got {blocks.dtype} "
                         f"{tuple(blocks.shape)} on {blocks.device}")
    if blocks.shape[1] != row_bytes(qtype, k):
        raise ValueError(f"{qtype} rows of {k} weights take {row_bytes(qtype, k)} bytes, blocks has {blocks.shape[1]}")


def matmul(lib: ctypes.CDLL, blocks: torch.Tensor, qtype: str, k: int, x: torch.Tensor,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, k] @ W^T -> [T, n] for W [n, k] stored as `blocks` [n, row_bytes] uint8 of GGUF type `qtype`.

    x: float32 or bfloat16 on the CPU, last dim contiguous. `out`: None (a new
    [T, n] tensor of x's dtype) or a [T, n] tensor of x's dtype with a contiguous
    last dim and any row stride (e.g. a column slice of a wider output), written in place.

    Raises:
        ValueError: layouts, dtypes or shapes other than these; `qtype` not in `KERNEL_BLOCKS`.
    """
    check_blocks(blocks, qtype, k)
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in DTYPES or x.device.type != "cpu" or x.stride(1) != 1:
        raise ValueError(f"x must be a CPU float32/bfloat16 [T, {k}] tensor with a contiguous last dim, got "
                         f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
    n, num_tokens = blocks.shape[0], x.shape[0]
    if out is None:
        out = torch.empty(num_tokens, n, dtype=x.dtype)
    elif out.shape != (num_tokens, n) or out.dtype != x.dtype or out.stride(1) != 1 or out.device.type != "cpu":
        raise ValueError(f"out must be a CPU {x.dtype} [{num_tokens}, {n}] tensor with a contiguous last dim")
    if num_tokens and n:
        rc = lib.gguf_matmul(blocks.data_ptr(), blocks.shape[1], KERNEL_BLOCKS[qtype][0], n, k, x.data_ptr(),
                             x.stride(0), num_tokens, out.data_ptr(), out.stride(0), int(x.dtype == torch.bfloat16),
                             torch.get_num_threads())
        if rc == -2:
            raise ValueError("gguf_matmul: could not allocate the float32 copy of x.")
        if rc != 0:
            raise ValueError(f"gguf_matmul: the kernel refused {qtype} rows of {k} weights.")
    return out


def dequantize(lib: ctypes.CDLL, blocks: torch.Tensor, qtype: str, k: int) -> torch.Tensor:
    """float32 [n, k] weights of `blocks` [n, row_bytes] uint8 (GGUF type `qtype`): `gguf.quants.dequantize`'s bits.

    Raises:
        ValueError: as `matmul`.
    """
    check_blocks(blocks, qtype, k)
    out = torch.empty(blocks.shape[0], k, dtype=torch.float32)
    if blocks.shape[0]:
        rc = lib.gguf_dequantize(blocks.data_ptr(), blocks.shape[1], KERNEL_BLOCKS[qtype][0], blocks.shape[0], k,
                                 out.data_ptr(), k, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"gguf_dequantize: the kernel refused {qtype} rows of {k} weights.")
    return out
