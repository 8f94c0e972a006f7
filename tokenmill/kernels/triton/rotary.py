"""Triton kernel: rotary position embedding of q and k in one launch.

Same result as tokenmill/layers/rotary.py's PyTorch path, bit for bit:
cos/sin are read from the float32 caches at each token's position and
rounded to the activation dtype D (the reference's `.to(query.dtype)`), and
every product, difference and sum is rounded to D as the reference's
separate ops do:

    o1 = round_D(round_D(x1 * cos) - round_D(x2 * sin))
    o2 = round_D(round_D(x2 * cos) + round_D(x1 * sin))

Pairs (x1, x2) of a head of size `head_size` whose first `rotary_dim`
dims rotate (i < rotary_dim / 2):

    neox (halves):   x1 = x[i], x2 = x[i + rotary_dim / 2]
    GPT-J (pairs):   x1 = x[2i], x2 = x[2i + 1]
    | rotated: rotary_dim | copied: head_size - rotary_dim |

Grid: (num_tokens, q head blocks + k head blocks); one program rotates
BLOCK_H heads of one token, of q or of k. Inputs may be row-strided views
(q and k carved out of the fused qkv projection); outputs are new
contiguous tensors, so the inputs are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.triton.numerics import FUSED_DTYPES, round_code, round_to

# Elements per program (heads * padded half rotary dim).
_HEAD_ELEMENTS = 1024


@triton.jit
def rotary_kernel(
    positions_ptr,  # [T] int64/int32
    q_ptr,  # [T, num_q_heads * HEAD_SIZE], row stride stride_q
    k_ptr,  # [T, num_k_heads * HEAD_SIZE], row stride stride_k
    q_out_ptr,  # [T, num_q_heads * HEAD_SIZE] contiguous
    k_out_ptr,  # [T, num_k_heads * HEAD_SIZE] contiguous
    cos_ptr,  # [max_position, ROT_HALF] (float32 cache), row stride stride_cos
    sin_ptr,  # like cos
    stride_q,
    stride_k,
    stride_cos,
    num_q_heads,
    num_k_heads,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,  # rotary_dim // 2
    ROT_HALF_PAD: tl.constexpr,  # next power of two >= ROT_HALF
    REST_PAD: tl.constexpr,  # next power of two >= HEAD_SIZE - 2 * ROT_HALF; 0 = no unrotated tail
    IS_NEOX: tl.constexpr,
    ROUND: tl.constexpr,  # activation dtype: see numerics.round_to
    BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    is_q = block < num_q_blocks
    # Scalar selects (not an if/else) so q and k share one straight-line body.
    src = tl.where(is_q, q_ptr + tok * stride_q, k_ptr + tok * stride_k)
    dst = tl.where(is_q, q_out_ptr + tok * num_q_heads * HEAD_SIZE, k_out_ptr + tok * num_k_heads * HEAD_SIZE)
    num_heads = tl.where(is_q, num_q_heads, num_k_heads)
    first_head = tl.where(is_q, block, block - num_q_blocks) * BLOCK_H

    heads = first_head + tl.arange(0, BLOCK_H)
    head_off = (heads * HEAD_SIZE)[:, None]
    head_mask = (heads < num_heads)[:, None]
    i = tl.arange(0, ROT_HALF_PAD)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    cos = round_to(tl.load(cos_ptr + pos * stride_cos + i, mask=i < ROT_HALF, other=0.0).to(tl.float32), ROUND)
    sin = round_to(tl.load(sin_ptr + pos * stride_cos + i, mask=i < ROT_HALF, other=0.0).to(tl.float32), ROUND)
    cos = cos[None, :]
    sin = sin[None, :]
    if IS_NEOX:
        off1 = i
        off2 = i + ROT_HALF
    else:
        off1 = 2 * i
        off2 = 2 * i + 1
    mask = head_mask & (i < ROT_HALF)[None, :]
    x1 = tl.load(src + head_off + off1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + head_off + off2[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = round_to(round_to(x1 * cos, ROUND) - round_to(x2 * sin, ROUND), ROUND)
    o2 = round_to(round_to(x2 * cos, ROUND) + round_to(x1 * sin, ROUND), ROUND)
    tl.store(dst + head_off + off1[None, :], o1, mask=mask)
    tl.store(dst + head_off + off2[None, :], o2, mask=mask)
    if REST_PAD > 0:
        j = 2 * ROT_HALF + tl.arange(0, REST_PAD)
        rest_mask = head_mask & (j < HEAD_SIZE)[None, :]
        rest = tl.load(src + head_off + j[None, :], mask=rest_mask)
        tl.store(dst + head_off + j[None, :], rest, mask=rest_mask)


def rotary_supported(query: torch.Tensor, key: torch.Tensor, head_size: int) -> bool:
    """Whether `rotary_embedding` takes these q/k (else use the PyTorch path).

    Needs float32/float16/bfloat16 q and k of one dtype whose rows can be
    viewed as [T, heads * head_size] with a contiguous last dim.
    """
    return (query.dtype in FUSED_DTYPES and key.dtype == query.dtype
            and _row_view(query, head_size) is not None and _row_view(key, head_size) is not None)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, head_size: int, rotary_dim: int,
                     is_neox_style: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k by their tokens' positions in one launch (see the module docstring).

    Args:
        positions: [T] int64/int32; every value < cos_cache.shape[0] (not
            checked: the kernel reads cos/sin at it, as index_select would).
        query: [T, num_q_heads * head_size] or [T, num_q_heads, head_size];
            may be a row-strided view (last dim contiguous).
        key: same layout with num_k_heads; same dtype as query.
        cos_cache, sin_cache: [max_position, rotary_dim // 2], any float
            dtype (float32 in RotaryEmbedding), rounded to q's dtype at use.
        head_size: size of each head.
        rotary_dim: leading dims of each head that rotate (even, <= head_size).
        is_neox_style: rotate halves (True) or adjacent pairs (False).

    Returns:
        (q, k): new contiguous tensors of query's and key's shapes; the
        inputs are not modified.

    Raises:
        ValueError: unsupported dtypes or layouts (see `rotary_supported`),
            or rotary_dim odd or larger than head_size.
    """
    if not rotary_supported(query, key, head_size):
        raise ValueError(f"No fused RoPE for query {tuple(query.shape)} {query.dtype} / key {tuple(key.shape)} "
                         f"{key.dtype} with head_size {head_size} (needs float32/float16/bfloat16 and rows of "
                         "whole heads with a contiguous last dim).")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"rotary_dim must be even and in (0, head_size={head_size}], got {rotary_dim}.")
    q_rows, k_rows = _row_view(query, head_size), _row_view(key, head_size)
    num_tokens = positions.shape[0]
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_q_heads = q_rows.shape[1] // head_size
    num_k_heads = k_rows.shape[1] // head_size
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    assert q_rows.shape[0] == num_tokens and k_rows.shape[0] == num_tokens, "positions, query and key lengths differ"
    assert cos_cache.stride(1) == 1 and sin_cache.stride() == cos_cache.stride()
    rot_half = rotary_dim // 2
    rot_half_pad = triton.next_power_of_2(rot_half)
    rest = head_size - rotary_dim
    block_h = min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), max(1, _HEAD_ELEMENTS // rot_half_pad))
    grid = (num_tokens, triton.cdiv(num_q_heads, block_h) + triton.cdiv(num_k_heads, block_h))
    rotary_kernel[grid](
        positions if positions.stride(0) == 1 else positions.contiguous(),
        q_rows,
        k_rows,
        q_out,
        k_out,
        cos_cache,
        sin_cache,
        q_rows.stride(0),
        k_rows.stride(0),
        cos_cache.stride(0),
        num_q_heads,
        num_k_heads,
        HEAD_SIZE=head_size,
        ROT_HALF=rot_half,
        ROT_HALF_PAD=rot_half_pad,
        REST_PAD=triton.next_power_of_2(rest) if rest else 0,
        IS_NEOX=is_neox_style,
        ROUND=round_code(query.dtype),
        BLOCK_H=block_h,
        num_warps=4,
        enable_fp_fusion=False,  # no a*b-c*d contractions: PyTorch rounds each op
    )
    return q_out, k_out


def _row_view(x: torch.Tensor, head_size: int) -> torch.Tensor | None:
    """x as [T, heads * head_size] with a contiguous last dim (a view, no copy), or None if it has no such view."""
    if x.dim() == 3 and x.shape[2] == head_size and x.stride(2) == 1 and x.stride(1) == head_size:
        return x.view(x.shape[0], -1) if x.shape[1] > 0 else x.reshape(x.shape[0], 0)
    if x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % head_size == 0:
        return x
    return None
