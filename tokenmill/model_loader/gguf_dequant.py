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

from tokenmill.kernels.cpu.gguf_matmul import KERNEL_BLOCKS

# bytes per block (one table of the layouts: kernels/cpu/gguf_matmul.KERNEL_BLOCKS)
_BLOCK_BYTES = {name: KERNEL_BLOCKS[name][2] for name in ("Q8_0", "Q4_0", "Q4_1")}
FAST_TYPES = frozenset(_BLOCK_BYTES)


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
