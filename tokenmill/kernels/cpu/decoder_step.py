"""A one-token decode step through a whole Llama-style stack in one C call (`decoder_step.c`).

At concurrency 1 on a small model the step's Python (module calls, tensor
allocations, ctypes argument conversion around ~150 C kernel calls) costs as
much as the quantized matmuls (SmolLM2-135M Q4_1: ~5 of ~18 ms at one
thread; docs/benchmarks.md "Where a concurrency-1 decode step goes"). The C
file calls the same kernels (RMSNorm, GGUF matmul, RoPE, decode attention,
SiLU-and-mul) in the modules' order, so its hidden state is the module
path's bits. `DecoderStepPlan` holds the per-layer pointers, packed once;
`models/cpu_fused_decode.py` decides which models and steps take it.

Built by `build.py` (system C compiler, cached per machine); without it, or
with `TOKENMILL_CPU_KERNELS=0`, `load()` returns None.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.kernels.cpu import gguf_matmul
from tokenmill.kernels.cpu.build import load_library

_SOURCE = Path(__file__).with_name("decoder_step.c")
# The C file's layer layout (MAX_SEGS, SEG_WORDS, LIN_WORDS, LAYER_HEAD, LAYER_WORDS).
MAX_SEGS = 4
SEG_WORDS = 5
LIN_WORDS = 1 + MAX_SEGS * SEG_WORDS
LAYER_HEAD = 5
LAYER_WORDS = LAYER_HEAD + 4 * LIN_WORDS


def _configure(lib: ctypes.CDLL) -> None:
    i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    lib.decoder_step.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, ptr, i64, i64, i64, i64, i64,
                                 i64, f32, f32, c_int]
    lib.decoder_step.restype = c_int


def load() -> ctypes.CDLL | None:
    """The compiled library (built on the first call, see `build.py`); None when unavailable."""
    return load_library(_SOURCE, _configure)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer's float32 tensors and GGUF linears, as the C step reads them.

    input_norm / post_norm: [hidden] float32, contiguous. segments: for qkv, o, gate_up and down (in that
    order), each linear's (blocks [rows, row_bytes] uint8, ggml type name, first output row) runs.
    window: sliding window in tokens, or None.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    segments: tuple[list[tuple[torch.Tensor, str, int]], ...]
    window: int | None


class DecoderStepPlan:
    """The packed pointers of a stack's layers and the step's scratch (float32, one token).

    Args:
        layers: per layer, its `LayerWeights` (the tensors stay referenced here).
        final_norm: [hidden] float32.
        cos_cache / sin_cache: [max_position, head_dim / 2] float32, contiguous (neox RoPE, whole head).
        hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size: the layer shapes.
        eps: RMSNorm epsilon; scale: attention score scale.

    Raises:
        ValueError: a linear of more than MAX_SEGS segments, a tensor not float32 contiguous, or a
            type `gguf_matmul` does not keep.
    """

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float, scale: float) -> None:
        for t in (final_norm, cos_cache, sin_cache, *(x for lw in layers for x in (lw.input_norm, lw.post_norm))):
            if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError("decoder_step: norm weights and the RoPE tables must be contiguous CPU float32")
        words = torch.zeros(len(layers), LAYER_WORDS, dtype=torch.int64)
        for i, lw in enumerate(layers):
            words[i, 0], words[i, 1] = lw.input_norm.data_ptr(), lw.post_norm.data_ptr()
            words[i, 4] = lw.window or 0
            for j, segs in enumerate(lw.segments):
                if not 1 <= len(segs) <= MAX_SEGS:
                    raise ValueError(f"decoder_step: a linear of {len(segs)} segments (1 to {MAX_SEGS} taken)")
                base = LAYER_HEAD + j * LIN_WORDS
                words[i, base] = len(segs)
                for s, (blocks, qtype, start) in enumerate(segs):
                    o = base + 1 + s * SEG_WORDS
                    words[i, o:o + SEG_WORDS] = torch.tensor(
                        [blocks.data_ptr(), blocks.shape[1], gguf_matmul.KERNEL_BLOCKS[qtype][0], blocks.shape[0],
                         start])
        self.layers = layers
        self.words = words
        self.final_norm = final_norm
        self.cos_cache, self.sin_cache = cos_cache, sin_cache
        self.shape = (hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size)
        self.eps, self.scale = eps, scale
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.scratch = torch.empty(3 * hidden_size + 3 * q + 2 * kv + 3 * intermediate_size, dtype=torch.float32)
        self.cache_list: list[torch.Tensor] | None = None  # the kv_caches list whose pointers `words` holds

    def set_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Point each layer at its cache [2, num_blocks, block_size, Hkv, D] (float32, contiguous);
        cheap when `kv_caches` is the list of the last call."""
        if kv_caches is self.cache_list:
            return
        for i, cache in enumerate(kv_caches):
            self.words[i, 2], self.words[i, 3] = cache[0].data_ptr(), cache[1].data_ptr()
        self.cache_list = kv_caches

    def run(self, lib: ctypes.CDLL, hidden: torch.Tensor, positions: torch.Tensor, slot: int, seq_len: int,
            block_row: torch.Tensor, block_size: int) -> None:
        """One token: hidden [1, hidden_size] float32 contiguous (the embedding) is overwritten with the final
        normed hidden state. positions [1] int64 contiguous; slot: the token's cache slot (>= 0); seq_len:
        keys attended (the token's own included); block_row: the request's block-table row, int32 contiguous.

        Raises:
            ValueError: the kernel refused a layout (see `decoder_step.c`) or could not allocate.
        """
        h, nh, nkv, d, inter = self.shape
        rc = lib.decoder_step(self.words.data_ptr(), self.words.shape[0], hidden.data_ptr(),
                              self.final_norm.data_ptr(), self.scratch.data_ptr(), self.cos_cache.data_ptr(),
                              self.sin_cache.data_ptr(), self.cos_cache.shape[0], positions.data_ptr(), slot, seq_len,
                              block_row.data_ptr(), h, nh, nkv, d, inter, block_size, self.eps, self.scale,
                              torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"decoder_step: a kernel refused the step ({rc}).")
