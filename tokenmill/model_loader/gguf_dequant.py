"""Fast dequantization of the common legacy GGUF block types (NumPy, in place, single-threaded).

Same arithmetic as the `gguf` package's reference (`gguf/quants.py`, itself
ggml's `dequantize_row_*`), so results are bitwise equal, but written into
one preallocated float32 array without the reference's temporaries: about
2x faster on the bundled SmolLM2 (Q4_1 + Q8_0). Single-threaded on purpose:
multi-threaded torch ops here collapsed (20x slower) on an oversubscribed
2-core machine, so GGUF loading stays in NumPy until the final tensor. Other types fall back to `gguf.quants.dequantize`.

Block layouts (32 weights per block; d, m are float16):

    Q8_0: | d | q[32] int8 |                  w = d * q
    Q4_0: | d | qs[16] |                      w = d * (nibble - 8)
    Q4_1: | d | m | qs[16] |                  w = d * nibble + m
    nibbles: weight j < 16 is qs[j] & 0xF, weight j + 16 is qs[j] >> 4
"""

from __future__ import annotations

import numpy as np

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
FAST_TYPES = frozenset(_BLOCK_BYTES)

# ggml type name -> (ggml_type id, weights per block, bytes per block) of the types the CPU kernels
# (`kernels/cpu/gguf_matmul.c`) keep quantized; ggml-common.h's block_q4_0, block_q4_1, block_q8_0
# (32 weights) and block_q4_K, block_q6_K (256-weight superblocks; layouts in the C file's header).
KERNEL_BLOCKS: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
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


def fast_dequantize(raw: np.ndarray, qtype_name: str) -> np.ndarray | None:
    """float32 weights [n_blocks * 32] (a new writable array) from raw uint8 block data; None for other types.

    `raw`: uint8 array of whole blocks (any shape), e.g. `GGUFFile.tensor_data(info)`.
    """
    block_bytes = _BLOCK_BYTES.get(qtype_name)
    if block_bytes is None:
        return None
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    out = np.empty((blocks.shape[0], 32), dtype=np.float32)
    d = np.ascontiguousarray(blocks[:, 0:2]).view(np.float16).astype(np.float32)  # [n_blocks, 1]
    if qtype_name == "Q8_0":
        out[:] = blocks[:, 2:].view(np.int8)
        out *= d
        return out.reshape(-1)
    qs = blocks[:, 4:] if qtype_name == "Q4_1" else blocks[:, 2:]
    np.bitwise_and(qs, 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(qs, 4, out=out[:, 16:], casting="unsafe")
    if qtype_name == "Q4_0":
        out -= 8.0
        out *= d
    else:
        out *= d
        out += np.ascontiguousarray(blocks[:, 2:4]).view(np.float16).astype(np.float32)
    return out.reshape(-1)
