"""Attention through torch's fused `scaled_dot_product_attention` kernels (prefill).

Token-major tensors ([len, heads, D], as the model and the paged cache hold
them) go in as 4-D [1, heads, len, D] views, the only layout for which
PyTorch's CPU dispatcher picks its fused flash kernel; with 3-D inputs (or a
3-D mask) it falls back to the math path, which builds the whole [H, Q, T]
score tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.kernels.kv_fp8 import gather_blocks


def fresh_prefill_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Causal attention of a whole new prompt over itself with torch SDPA.

    q [Q, H, D], k/v [Q, Hkv, D] -> [Q, H, D].
    """
    qlen = q.shape[0]
    if window is None or window >= qlen:
        return sdpa(q, k, v, scale, causal=True)
    pos = torch.arange(qlen, device=q.device)
    diff = pos[:, None] - pos[None, :]  # query pos - key pos
    return sdpa(q, k, v, scale, mask=(diff >= 0) & (diff < window))


def chunk_sdpa(
    q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, bias: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """A prefill chunk over its cached context plus itself (keys of `block_ids`) with torch SDPA.

    q [Q, H, D] -> [Q, H, D]; kv_cache [2, num_blocks, bs, Hkv, D] in q's dtype or fp8 (cast exactly to
    q's dtype; the caller folds the fp8 scales into `scale` and the output);
    block_ids [nb] int64, the request's blocks in order (T = nb * bs keys);
    bias [1, 1, 1, Q, T] float32, 0 where visible and -inf where masked
    (causal, window, past seq_len), or None when every key is visible.
    The blocks are gathered once and the mask goes to the fused kernel,
    which never builds the [H, Q, T] scores (216-token chunk after a
    16-token prefix hit, SmolLM2, one thread: 1.9 -> 1.1 ms per layer).
    """
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    k = gather_blocks(kv_cache[0], block_ids).view(-1, num_kv_heads, head_dim)
    v = gather_blocks(kv_cache[1], block_ids).view(-1, num_kv_heads, head_dim)
    mask = None if bias is None else bias[:, 0]  # [1, 1, 1, Q, T] -> [1, 1, Q, T]
    return sdpa(q, k.to(q.dtype), v.to(q.dtype), scale, mask=mask)


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """torch SDPA on token-major tensors: q [Q, H, D], k/v [T, Hkv, D] -> [Q, H, D].

    `mask`: [Q, T] or [1, 1, Q, T] (the fused CPU kernel takes no other
    shape), bool (True = visible) or additive float. The inputs go in as
    4-D [1, heads, len, D] views: on CPU only 4-D inputs (and 2-D or 4-D
    masks) reach the fused (tiled) flash kernel, others fall back to the math path
    that materializes [H, Q, T] scores (216-token prompt, SmolLM2, one thread:
    4.2 -> 1.4 ms per layer). GQA goes through `enable_gqa` on CPU, so K/V
    heads are not copied; other devices get repeated heads, which all their
    kernels accept.
    """
    group = q.shape[1] // k.shape[1]
    gqa = group > 1 and q.device.type == "cpu"
    if group > 1 and not gqa:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if mask is not None and mask.dtype != torch.bool and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)
