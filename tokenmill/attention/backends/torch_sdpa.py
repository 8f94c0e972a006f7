"""TORCH_SDPA: the reference paged-attention backend, in plain PyTorch ops.

Runs wherever PyTorch runs (CPU, any CUDA GPU including cc 7.0). Each step:

1. write the new keys/values into the paged cache at `slot_mapping`;
2. attend, per request, over the request's blocks:

       request i:  | cached (context_len) | new (query_len) |
                   |<------------- seq_len --------------->|

   new token j (absolute position p = context_len + j) sees key positions
   k with k <= p, and with a sliding window W also k > p - W (HF's mask).

Decodes (query_len 1) of a step are batched into one padded gather and one
batched matmul; each prefill chunk is attended on its own. When a request's
keys do not fit one tile (`kv_tile_size` keys), the keys are visited in
tiles with an online softmax (running max `m` and sum `l`; Milakov &
Gimelshein 2018, arXiv:1805.02867; FlashAttention, Dao et al. 2022), so no
score tensor is larger than [heads, query_len, tile] per request.
A fresh prompt (no cached context, no soft-cap) goes straight to
`torch.nn.functional.scaled_dot_product_attention`, whose CPU/CUDA kernels
are themselves tiled.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from tokenmill.attention.metadata import AttentionMetadata


class TorchSDPABackend:
    """Paged attention with torch ops; see the module docstring.

    Args:
        kv_tile_size: keys per tile for a prefill chunk (rounded down to whole
            blocks, at least one block). Smaller = less memory, more steps.
        decode_tile_budget: max keys gathered at once over the whole decode
            batch (rows x keys); the per-row tile is this // num_decodes.
        use_sdpa_prefill: route fresh prompts to torch's fused SDPA (tests
            turn it off to exercise the paged path).
    """

    name = "TORCH_SDPA"

    def __init__(
        self, kv_tile_size: int = 1024, decode_tile_budget: int = 64 * 1024, use_sdpa_prefill: bool = True
    ) -> None:
        if kv_tile_size < 1:
            raise ValueError(f"kv_tile_size must be >= 1, got {kv_tile_size}.")
        self.kv_tile_size = kv_tile_size
        self.decode_tile_budget = decode_tile_budget
        self.use_sdpa_prefill = use_sdpa_prefill

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write K/V to the cache, then attend. See `AttentionBackend.forward`.

        Shapes: query [T, H, D], key/value [T, Hkv, D], kv_cache [2, num_blocks,
        block_size, Hkv, D]; returns [T, H, D] in query's dtype. Rows past
        `num_actual_tokens` (padding) are left zero.
        """
        n = attn_metadata.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, attn_metadata.slot_mapping[:n])
        qsl = attn_metadata.query_start_loc_cpu
        seq_lens = attn_metadata.seq_lens_cpu
        num_reqs = attn_metadata.num_reqs
        query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
        args = (scale, sliding_window, logits_soft_cap)

        decode_reqs = np.flatnonzero(query_lens == 1)
        if len(decode_reqs) == num_reqs == query.shape[0]:
            # Pure decode step, no padding: token i is request i, no scatter needed.
            return self._decode_batch(query, kv_cache, attn_metadata, decode_reqs, *args)
        out = torch.zeros_like(query)
        if len(decode_reqs) > 0:
            tok = torch.from_numpy(qsl[decode_reqs].astype(np.int64)).to(query.device, non_blocking=True)
            out[tok] = self._decode_batch(query, kv_cache, attn_metadata, decode_reqs, *args)
        for i in np.flatnonzero(query_lens > 1).tolist():
            start, end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(seq_lens[i])
            q = query[start:end]
            if self.use_sdpa_prefill and seq_len == end - start and logits_soft_cap is None:
                out[start:end] = _fresh_prefill_sdpa(q, key[start:end], value[start:end], scale, sliding_window)
                continue
            out[start:end] = self._prefill_chunk(q, kv_cache, attn_metadata.block_table[i], seq_len, *args)
        return out

    def _prefill_chunk(
        self,
        q: torch.Tensor,  # [Q, H, D]
        kv_cache: torch.Tensor,
        block_row: torch.Tensor,  # [max_blocks] int32
        seq_len: int,
        scale: float,
        window: int | None,
        cap: float | None,
    ) -> torch.Tensor:
        qlen, num_heads, head_dim = q.shape
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        first_pos = seq_len - qlen
        # With a window, blocks wholly before the first query's window are skipped.
        start_block = max(0, first_pos - window + 1) // block_size if window else 0
        end_block = -(-seq_len // block_size)
        block_idx = torch.arange(start_block, end_block, device=q.device)[None]  # [1, nb]
        qpos = torch.arange(first_pos, seq_len, device=q.device)[None]  # [1, Q]
        q5 = q.view(qlen, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)[None]
        tile_blocks = max(1, self.kv_tile_size // block_size)
        out = _paged_attention(q5, kv_cache, block_row[None], block_idx, qpos, scale, window, cap, tile_blocks)
        # [1, Hkv, G, Q, D] -> [Q, H, D]
        return out[0].permute(2, 0, 1, 3).reshape(qlen, num_heads, head_dim)

    def _decode_batch(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        reqs: np.ndarray,  # [B] request indices with query_len 1
        scale: float,
        window: int | None,
        cap: float | None,
    ) -> torch.Tensor:  # [B, H, D]: the decode tokens' outputs, in `reqs` order
        device = query.device
        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        _, num_heads, head_dim = query.shape
        bsz = len(reqs)
        seq_lens = md.seq_lens_cpu[reqs].astype(np.int64)
        # Per row, the blocks that can hold visible keys:
        #   seq_lens [5, 40], block 16, window 8 -> first [0, 2], last [0, 2] (blocks of pos 32..39)
        first = np.maximum(0, seq_lens - window) // block_size if window else np.zeros_like(seq_lens)
        nblocks = -(-seq_lens // block_size) - first
        # block_idx[b, t] = first[b] + t; entries past a row's end are masked by position.
        block_idx = first[:, None] + np.arange(int(nblocks.max()))[None]
        block_idx_t = torch.from_numpy(block_idx).to(device, non_blocking=True)
        qpos = torch.from_numpy(seq_lens - 1).to(device, non_blocking=True)[:, None]  # [B, 1]
        if bsz == md.num_reqs:
            q, block_rows = query[:bsz], md.block_table[:bsz]
        else:
            tok = torch.from_numpy(md.query_start_loc_cpu[reqs].astype(np.int64)).to(device, non_blocking=True)
            rows = torch.from_numpy(reqs).to(device, non_blocking=True)
            q, block_rows = query[tok], md.block_table[rows]
        q5 = q.view(bsz, num_kv_heads, num_heads // num_kv_heads, 1, head_dim)
        tile_blocks = max(1, self.decode_tile_budget // (bsz * block_size))
        o = _paged_attention(q5, kv_cache, block_rows, block_idx_t, qpos, scale, window, cap, tile_blocks)
        return o.reshape(bsz, num_heads, head_dim)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot; slot -1 (padding) is skipped.

    key/value: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64 (slot = block_id * block_size + offset).
    """
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    if slot_mapping.numel() == 0:
        return
    if slot_mapping.device.type != "cpu" or int(slot_mapping.min()) < 0:
        # Boolean indexing costs a device sync on CUDA; the fallback backend accepts it.
        valid = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _fresh_prefill_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None
) -> torch.Tensor:
    """Causal attention of a whole new prompt over itself with torch SDPA.

    q [Q, H, D], k/v [Q, Hkv, D] -> [Q, H, D]. K/V heads are repeated for GQA
    (cheap at prompt length) so torch can pick its fused kernels.
    """
    qlen, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if window is None or window >= qlen:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        pos = torch.arange(qlen, device=q.device)
        diff = pos[:, None] - pos[None, :]  # query pos - key pos
        mask = (diff >= 0) & (diff < window)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _paged_attention(
    q: torch.Tensor,  # [B, Hkv, G, Q, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_rows: torch.Tensor,  # [B, max_blocks_per_req] int32 block ids
    block_idx: torch.Tensor,  # [B, nb] int64 logical block indices to visit (may run past a row's end)
    qpos: torch.Tensor,  # [B, Q] int64 absolute query positions
    scale: float,
    window: int | None,
    cap: float | None,
    tile_blocks: int,
) -> torch.Tensor:  # [B, Hkv, G, Q, D] in q's dtype
    """Attention of B query groups over their paged keys, tiled with an online softmax.

    Key position of (b, t, o) = block_idx[b, t] * block_size + o; it is visible
    to query position p iff key_pos <= p (which also keeps it < seq_len) and,
    with a window W, key_pos > p - W. Each tile gathers `tile_blocks` blocks per
    row, so the largest score tensor is [B, Hkv, G, Q, tile_blocks * block_size].
    """
    bsz, num_kv_heads, group, qlen, head_dim = q.shape
    block_size = kv_cache.shape[2]
    nb = block_idx.shape[1]
    width = block_rows.shape[1]
    offsets = torch.arange(block_size, device=q.device)
    q_flat = q.reshape(bsz, num_kv_heads, group * qlen, head_dim)
    m = l = acc = None
    for t0 in range(0, nb, tile_blocks):
        idx = block_idx[:, t0 : t0 + tile_blocks]  # [B, nbt]
        ntok = idx.shape[1] * block_size
        # Logical index past the table's width only occurs for masked keys; clamp to stay in bounds.
        ids = torch.gather(block_rows, 1, idx.clamp(max=width - 1)).flatten().long()
        kpos = (idx[:, :, None] * block_size + offsets).reshape(bsz, ntok)  # [B, T]
        # index_select keeps the cache layout: [B*nbt, bs, Hkv, D] -> [B, T, Hkv, D]. Slicing one
        # KV head gives a strided [B, T, D] that bmm takes without a copy (a 4-D matmul
        # over [B, Hkv] would first copy K into [B, Hkv, T, D]).
        k = kv_cache[0].index_select(0, ids).view(bsz, ntok, num_kv_heads, head_dim)
        v = kv_cache[1].index_select(0, ids).view(bsz, ntok, num_kv_heads, head_dim)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        s = torch.stack(
            [torch.bmm(q_flat[:, h], k[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], dim=1
        ).float() * scale  # [B, Hkv, G*Q, T]
        if cap is not None:
            s = torch.tanh(s / cap) * cap
        visible = kpos[:, None, :] <= qpos[:, :, None]  # [B, Q, T]
        if window is not None:
            visible &= kpos[:, None, :] > qpos[:, :, None] - window
        s = s.view(bsz, num_kv_heads, group, qlen, ntok).masked_fill_(~visible[:, None, None], float("-inf"))
        tile_max = s.amax(dim=-1)  # [B, Hkv, G, Q]
        if m is None:
            m_new = tile_max
        else:
            m_new = torch.maximum(m, tile_max)
        # A row with nothing visible yet keeps max -inf; subtract 0 instead so exp gives 0, not NaN.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        p_flat = p.view(bsz, num_kv_heads, group * qlen, ntok).to(v.dtype)
        pv = torch.stack([torch.bmm(p_flat[:, h], v[:, :, h]) for h in range(num_kv_heads)], dim=1).float()
        pv = pv.view(bsz, num_kv_heads, group, qlen, head_dim)
        if m is None:
            l, acc = p.sum(dim=-1), pv
        else:
            corr = torch.exp(m - m_safe)
            l = l * corr + p.sum(dim=-1)
            acc = acc * corr[..., None] + pv
        m = m_new
    assert acc is not None and l is not None, "every request has at least one key"
    return (acc / l[..., None]).to(q.dtype)
