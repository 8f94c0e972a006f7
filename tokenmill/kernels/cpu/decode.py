"""CPU decode attention in C (`decode_attention.c`), compiled at first use; None when it cannot be.

TORCH_SDPA's PyTorch decode path on CPU (`block_decode`) multiplies each
16-key block by its owner's query in batched matmuls: hundreds of tiny
matmuls per layer, whose fixed costs and the softmax bookkeeping around them
set its speed, not the memory traffic. The C kernel reads each key and value
once, keeps the scores and sums in float32 vector registers (AVX-512 where
the CPU has it), and writes the result straight into the attention output.
(SmolLM2-135M bfloat16, 64 decodes of 150-200 keys, 2 threads: 0.55 vs
1.56 ms per layer; benchmarks/cpu_kernels_bench.py, docs/benchmarks.md
"CPU serving: fifth session".)

An fp8 KV cache (float8_e4m3fn / float8_e5m2, `kernels/kv_fp8.py`) is read
as its bytes and decoded exactly in the kernel, with the layer's k_scale /
v_scale folded into the score scale and the output.

Built by `tokenmill.kernels.cpu.build` at the first `load_kernel()` (the
system C compiler, cached per machine); no compiler, a failed build, or
`TOKENMILL_CPU_KERNELS=0` -> None, and the caller keeps the PyTorch path.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.dtypes import is_fp8
from tokenmill.kernels.cpu.build import load_library
from tokenmill.kernels.kv_fp8 import kv_fp8_code, kv_unit

_SOURCE = Path(__file__).with_name("decode_attention.c")
# The kernel's limits (MAX_GROUP, MAX_HEAD_DIM in the C source); other models keep the PyTorch path.
MAX_GROUP = 16
MAX_HEAD_DIM = 256


def _configure(lib: ctypes.CDLL) -> None:
    i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    fn = lib.paged_decode_attention
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, f32, f32,
                   c_int, c_int, f32, c_int]
    fn.restype = c_int


def load_kernel() -> ctypes.CDLL | None:
    """The compiled library (built on the first call, see `build.py`); None when unavailable."""
    return load_library(_SOURCE, _configure)


def kernel_supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when the C kernel takes these tensors: CPU, float32 or bfloat16 query, the cache in the query's
    dtype or fp8, a contiguous cache, each row's heads contiguous, and G = H / Hkv <= MAX_GROUP,
    head_dim <= MAX_HEAD_DIM."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    return (query.device.type == "cpu" and (query.dtype == kv_cache.dtype or is_fp8(kv_cache.dtype))
            and query.dtype in (torch.float32, torch.bfloat16) and kv_cache.is_contiguous()
            and query.stride(2) == 1 and query.stride(1) == head_dim
            and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
            and head_dim <= MAX_HEAD_DIM)


@dataclass(slots=True)
class DecodeRows:
    """A step's decode rows in the layout the kernel reads, converted once and shared by every layer.

    table: [num_reqs, max_blocks] int32 block ids, last dim contiguous; req_idx / q_rows / seq_lens:
    [B] int64 contiguous (see `paged_decode_attention`). The tensors stay referenced here while
    the kernel reads their pointers.
    """

    table: torch.Tensor
    req_idx: torch.Tensor
    q_rows: torch.Tensor
    seq_lens: torch.Tensor


def decode_rows(block_table: torch.Tensor, req_idx: torch.Tensor, q_rows: torch.Tensor,
                seq_lens: torch.Tensor) -> DecodeRows:
    """Check and convert a step's decode rows once (`paged_decode_attention`'s index arguments).

    Raises:
        ValueError: index arrays of different lengths or not 1-D, or a block table off the CPU.
    """
    if not (req_idx.shape == q_rows.shape == seq_lens.shape and req_idx.dim() == 1):
        raise ValueError(f"req_idx, q_rows and seq_lens must be [B] alike, got {tuple(req_idx.shape)}, "
                         f"{tuple(q_rows.shape)}, {tuple(seq_lens.shape)}")
    if block_table.device.type != "cpu":
        raise ValueError("CPU decode kernel: the block table must be a CPU tensor")
    table = block_table if block_table.dtype == torch.int32 else block_table.to(torch.int32)
    if table.stride(1) != 1:
        table = table.contiguous()
    req_idx, q_rows, seq_lens = (t.to(torch.int64).contiguous() for t in (req_idx, q_rows, seq_lens))
    return DecodeRows(table, req_idx, q_rows, seq_lens)


def paged_decode_attention(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_idx: torch.Tensor,
    q_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention of B rows over their cached keys, written into `out[q_rows]`.

    Args:
        query: [T, H, D] float32 or bfloat16, the step's queries (each row's heads contiguous).
        kv_cache: [2, num_blocks, block_size, Hkv, D], query's dtype or fp8 (read as q8 * k_scale,
            q8 * v_scale), contiguous.
        block_table: [num_reqs, max_blocks] int32 physical block ids (CPU).
        req_idx: [B] int64 block-table row of each decode row.
        q_rows: [B] int64 token row of each decode row in `query` and `out`.
        seq_lens: [B] int64 keys each row attends to (its own included), >= 1.
        scale: score scale (usually head_dim ** -0.5).
        out: [T, H, D] query's dtype, each row's heads contiguous; rows q_rows are overwritten.
        window: sliding window W (keys at positions > p - W, HF's mask); None = all keys.
        cap: Gemma-2 soft-capping of the scores, cap * tanh(s / cap); None = off.
        k_scale, v_scale: an fp8 cache's scales (host floats); ignored for a float32 / bfloat16 cache.

    Raises:
        ValueError: tensors the kernel does not take (`kernel_supports`, `out`'s layout,
            index arrays of different lengths), or the score buffer could not be allocated.
    """
    if not kernel_supports(query, kv_cache) or out.device.type != "cpu":
        raise ValueError("CPU decode kernel: query/out must be CPU tensors of one float32/bfloat16 dtype, the "
                         "cache in that dtype or fp8 and contiguous, contiguous heads, and shapes within its limits "
                         "(kernel_supports)")
    decode_rows_attention(lib, query, kv_cache, decode_rows(block_table, req_idx, q_rows, seq_lens), scale, out,
                          window, cap, k_scale, v_scale)


def decode_rows_attention(lib: ctypes.CDLL, query: torch.Tensor, kv_cache: torch.Tensor, rows: DecodeRows,
                          scale: float, out: torch.Tensor, window: int | None = None, cap: float | None = None,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """`paged_decode_attention` with the step's rows from `decode_rows` (the per-layer call of a decode step).

    The caller has checked `kernel_supports(query, kv_cache)` for these tensors (once per layer).

    Raises:
        ValueError: `out`'s layout, or the score buffer could not be allocated.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if not (out.dtype == query.dtype and out.stride(2) == 1 and out.stride(1) == head_dim):
        raise ValueError(f"out must be {query.dtype} with contiguous heads, got {out.dtype} {tuple(out.stride())}")
    kv_fmt = kv_fp8_code(kv_cache.dtype)  # the C source's KV_FMT
    unit = kv_unit(kv_cache.dtype)
    table = rows.table
    k_cache = kv_cache.data_ptr()  # kv_cache[0] and [1] by address (the cache is contiguous): no select ops
    v_cache = k_cache + kv_cache.stride(0) * kv_cache.element_size()
    rc = lib.paged_decode_attention(
        query.data_ptr(), query.stride(0), k_cache, v_cache, out.data_ptr(),
        out.stride(0), table.data_ptr(), table.stride(0), rows.req_idx.data_ptr(), rows.q_rows.data_ptr(),
        rows.seq_lens.data_ptr(), rows.req_idx.shape[0], num_heads, num_kv_heads, head_dim, block_size, window or 0,
        scale * (k_scale * unit if kv_fmt else 1.0), cap or 0.0, int(query.dtype == torch.bfloat16), kv_fmt,
        v_scale * unit if kv_fmt else 1.0, torch.get_num_threads())
    if rc == -2:
        raise ValueError("CPU decode kernel: could not allocate its score buffer.")
    if rc != 0:
        raise ValueError(f"CPU decode kernel: {num_heads // num_kv_heads} query heads per KV head or head_dim "
                         f"{head_dim} is above its limits ({MAX_GROUP}, {MAX_HEAD_DIM}).")
