"""RMSNorm (+ residual add), SiLU-and-mul, RoPE and the KV-cache write on CPU in C (`elementwise.c`): one call
instead of 2-10 ops.

On a CPU each PyTorch op of the reference code (layernorm.py: ~9 ops per
add + RMSNorm; activation.py: 2) costs a few microseconds of dispatch and
one more pass over memory; a decode step of a 30-layer model runs ~60 norms,
30 activations, 30 RoPEs and 30 KV-cache writes (two `index_copy_` calls each, ~35 us per layer in all
at batch 64 on the 2-core dev VM, for a few KiB of rows). These C loops make one pass each, with the
reference's roundings (see the C file): in bfloat16 the outputs are the reference's bits
except where RMSNorm's float32 sum of squares, added in another order, moves
an element by one ulp; in float32 they differ in the last bits (the sum
order, SiLU's polynomial exp: up to ~4 ulps). NaN payloads may differ.

Built by `build.py` (system C compiler, cached per machine); without it,
or with `TOKENMILL_CPU_KERNELS=0`, `load()` returns None and the layers keep
their PyTorch path. Float32 and bfloat16 only.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from tokenmill.kernels.cpu.build import load_library

_SOURCE = Path(__file__).with_name("elementwise.c")
DTYPES = (torch.float32, torch.bfloat16)


def _configure(lib: ctypes.CDLL) -> None:
    i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    lib.rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, f32, c_int, c_int, c_int]
    lib.rms_norm.restype = None
    lib.silu_and_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, c_int, c_int]
    lib.silu_and_mul.restype = None
    lib.rotary_neox.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ptr, ptr, i64, c_int, c_int]
    lib.rotary_neox.restype = c_int
    lib.write_kv_cache.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
    lib.write_kv_cache.restype = c_int


def load() -> ctypes.CDLL | None:
    """The compiled library (built on the first call, see `build.py`); None when unavailable."""
    return load_library(_SOURCE, _configure)


def supports(x: torch.Tensor) -> bool:
    """True for a CPU float32/bfloat16 tensor of >= 1 dim whose last dim is contiguous and whose leading dims
    flatten to one row stride (the kernels' layout)."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() == 0 or x.stride(-1) != 1:
        return False
    if x.dim() <= 2:
        return True
    # [..., n]: the leading dims must be one strided run of rows.
    return x.is_contiguous()


def _rows(x: torch.Tensor) -> tuple[int, int]:
    """(rows, row stride in elements) of x seen as [rows, x.shape[-1]]."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return rows, (x.stride(0) if x.dim() == 2 else x.shape[-1])


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [..., n] (float32/bfloat16, see `supports`) with weight [n] of x's dtype.

    residual None -> the normed x, a new contiguous tensor of x's shape and dtype.
    residual [..., n] like x -> (RMSNorm(x + residual), x + residual), both new tensors (`RMSNorm.forward`).

    Raises:
        ValueError: x, weight or residual is not a layout the kernel takes (`supports`, weight [n] of x's dtype).
    """
    if not supports(x):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} {x.dtype} {x.device} is not a layout the kernel takes")
    n = x.shape[-1]
    if weight.dtype != x.dtype or weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"weight must be [{n}] {x.dtype}, contiguous; got {tuple(weight.shape)} {weight.dtype}")
    rows, x_stride = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu")
    if residual is None:
        if rows:
            lib.rms_norm(x.data_ptr(), x_stride, None, 0, None, 0, out.data_ptr(), n, weight.data_ptr(), rows, n,
                         eps, int(gemma), int(x.dtype == torch.bfloat16), torch.get_num_threads())
        return out
    if residual.shape != x.shape or residual.dtype != x.dtype or not supports(residual):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} with a contiguous last dim")
    summed = torch.empty(x.shape, dtype=x.dtype, device="cpu")
    if rows:
        lib.rms_norm(x.data_ptr(), x_stride, residual.data_ptr(), _rows(residual)[1], summed.data_ptr(), n,
                     out.data_ptr(), n, weight.data_ptr(), rows, n, eps, int(gemma),
                     int(x.dtype == torch.bfloat16), torch.get_num_threads())
    return out, summed


def silu_and_mul(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d] (float32/bfloat16, see `supports`); returns [..., d].

    Raises:
        ValueError: x is not a layout the kernel takes, or its last dim is odd.
    """
    if not supports(x) or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} {x.dtype} {x.device} needs an even last dim and a "
                         "layout the kernel takes")
    d = x.shape[-1] // 2
    rows, x_stride = _rows(x)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device="cpu")
    if rows and d:
        lib.silu_and_mul(x.data_ptr(), x_stride, out.data_ptr(), d, rows, d, int(x.dtype == torch.bfloat16),
                         torch.get_num_threads())
    return out


def rope_supports(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                  sin_cache: torch.Tensor) -> bool:
    """True for the layouts `rotary_neox` takes (see there): one row per position, whole heads of d."""
    d = 2 * cos_cache.shape[-1]
    if positions.dim() != 1 or positions.device.type != "cpu" or key.dtype != query.dtype:
        return False
    if not (cos_cache.dtype == sin_cache.dtype == torch.float32 and cos_cache.is_contiguous()
            and sin_cache.is_contiguous() and cos_cache.shape == sin_cache.shape and cos_cache.device.type == "cpu"):
        return False
    for x in (query, key):
        if not supports(x) or x.shape[0] != positions.shape[0]:
            return False
        if not ((x.dim() == 2 and x.shape[1] % d == 0) or (x.dim() == 3 and x.shape[2] == d and x.is_contiguous())):
            return False
    return True


def rotary_neox(lib: ctypes.CDLL, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE of every head (rotary_dim == head_size): `RotaryEmbedding.forward_torch`'s result.

    positions [T] int64 (CPU); query [T, nq * d] / key [T, nk * d] (2-D, last dim
    contiguous, any row stride) or contiguous [T, n, d], float32/bfloat16, same dtype;
    cos_cache / sin_cache [max_position, d / 2] float32, contiguous. Returns new
    contiguous (query, key) shaped like the inputs.

    Raises:
        ValueError: shapes or layouts other than these (`rope_supports`).
        IndexError: a position is outside [0, max_position) (as index_select would).
    """
    if not rope_supports(positions, query, key, cos_cache, sin_cache):
        raise ValueError(f"rotary_neox: positions {tuple(positions.shape)}, query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)}: not the [T], [T, n * d] / [T, n, d] layouts the kernel takes")
    num_tokens, half = positions.shape[0], cos_cache.shape[1]
    d = 2 * half
    q_out = torch.empty(query.shape, dtype=query.dtype, device="cpu")
    k_out = torch.empty(key.shape, dtype=key.dtype, device="cpu")
    if num_tokens:
        positions = positions if positions.dtype == torch.int64 and positions.is_contiguous() else \
            positions.to(torch.int64).contiguous()
        nq, nk = query.numel() // (num_tokens * d), key.numel() // (num_tokens * d)
        # stride(0) is the per-token stride of [T, n * d] and of a contiguous [T, n, d] alike.
        rc = lib.rotary_neox(positions.data_ptr(), query.data_ptr(), query.stride(0), nq, key.data_ptr(),
                             key.stride(0), nk, cos_cache.data_ptr(), sin_cache.data_ptr(), half, cos_cache.shape[0],
                             q_out.data_ptr(), k_out.data_ptr(), num_tokens, int(query.dtype == torch.bfloat16),
                             torch.get_num_threads())
        if rc != 0:
            raise IndexError(f"RoPE: a position is outside [0, {cos_cache.shape[0]}) (the model's max_position)")
    return q_out, k_out


def kv_write_supports(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> bool:
    """True for the layouts `write_kv_cache` takes (see there)."""
    if kv_cache.device.type != "cpu" or kv_cache.dtype not in DTYPES or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        return False  # [2 (K, V), blocks, block_size, kv heads, head dim]: the C write finds V one stride(0) on
    if not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1:
        return False
    if slot_mapping.device.type != "cpu" or not slot_mapping.is_contiguous():
        return False
    rows = (slot_mapping.shape[0], kv_cache.shape[3], kv_cache.shape[4])
    for x in (key, value):
        if x.device.type != "cpu" or x.dtype != kv_cache.dtype or tuple(x.shape) != rows:
            return False
        if x.stride(2) != 1 or x.stride(1) != rows[2]:  # each token's heads are one contiguous run
            return False
    return True


def write_kv_cache(lib: ctypes.CDLL, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Copy key / value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T] int64
    (slot = block * block_size + offset; -1, padding, is skipped), in place: `attention.backends.torch_sdpa.
    write_kv_cache` for a float32 / bfloat16 cache in the tokens' dtype, one C call instead of two index_copy_.

    key / value may be views with a token stride (slices of the fused qkv output); each token's Hkv * D
    elements must be contiguous. kv_cache contiguous; slot_mapping contiguous, on the CPU.

    Raises:
        ValueError: shapes, dtypes or layouts other than these (`kv_write_supports`).
        IndexError: a slot outside [-1, num_blocks * block_size) (nothing is written).
    """
    if not kv_write_supports(key, value, kv_cache, slot_mapping):
        raise ValueError(f"write_kv_cache: key {tuple(key.shape)} {key.dtype}, value {tuple(value.shape)} "
                         f"{value.dtype}, cache {tuple(kv_cache.shape)} {kv_cache.dtype}: not the [T, Hkv, D] "
                         "rows of the cache's dtype, with contiguous heads, that the kernel takes")
    num_tokens = slot_mapping.shape[0]
    if not num_tokens:
        return
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    k_cache = kv_cache.data_ptr()  # kv_cache[0] and [1] by address: no select ops
    v_cache = k_cache + kv_cache.stride(0) * kv_cache.element_size()
    rc = lib.write_kv_cache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), k_cache, v_cache,
                            slot_mapping.data_ptr(), num_tokens,
                            kv_cache.shape[3] * kv_cache.shape[4], num_slots, kv_cache.element_size())
    if rc != 0:
        raise IndexError(f"write_kv_cache: a slot is outside [-1, {num_slots}) (the cache's slots)")
