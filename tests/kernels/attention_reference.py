"""Random paged batches and a float64 PyTorch reference for the attention kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim] (num_tokens may include padding)
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    context_lens: list[int]
    query_lens: list[int]
    num_padding_tokens: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)


def make_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
    num_padding_tokens: int = 0,
    generator: torch.Generator,
) -> PagedBatch:
    """Scatter each request's K/V over random distinct blocks; every slot that
    belongs to no request holds NaN, so a kernel reading one unmasked fails."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    blocks_per_req = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # a few never-used blocks
    perm = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(max(blocks_per_req), 1) + 1  # one spare column stays 0
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=torch.float64)
    next_block = 0
    for i, (s, nb) in enumerate(zip(seq_lens, blocks_per_req, strict=True)):
        ids = perm[next_block : next_block + nb]
        next_block += nb
        block_table[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(s)
        # position p -> (block ids[p // block_size], offset p % block_size)
        kv_cache[:, torch.tensor(ids, dtype=torch.long)[pos // block_size], pos % block_size] = torch.randn(
            2, s, num_kv_heads, head_dim, generator=generator, dtype=torch.float64
        )
    num_tokens = sum(query_lens) + num_padding_tokens
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator, dtype=torch.float64)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return PagedBatch(
        query=query.to(dtype).to(device),
        kv_cache=kv_cache.to(dtype).to(device),
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=list(context_lens),
        query_lens=list(query_lens),
        num_padding_tokens=num_padding_tokens,
    )


def reference_attention(
    batch: PagedBatch,
    *,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 causal paged attention, written from the definition (one request
    at a time, explicit masks). `sinks` [num_heads]: one extra logit per head
    in each softmax, whose probability is dropped (gpt-oss). Returns
    [num_real_tokens, num_heads, head_dim]."""
    q_all = batch.query.double().cpu()
    cache = batch.kv_cache.double().cpu()
    table = batch.block_table.cpu()
    block_size = cache.shape[2]
    num_heads = q_all.shape[1]
    qpk = num_heads // cache.shape[3]
    outs = []
    start = 0
    for ctx, qlen in zip(batch.context_lens, batch.query_lens, strict=True):
        seq_len = ctx + qlen
        pos = torch.arange(seq_len)
        blocks = table[len(outs)][pos // block_size].long()
        k = cache[0, blocks, pos % block_size].repeat_interleave(qpk, dim=1)  # [S, H, D]
        v = cache[1, blocks, pos % block_size].repeat_interleave(qpk, dim=1)
        q = q_all[start : start + qlen]  # [Q, H, D]
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        q_pos = ctx + torch.arange(qlen)
        visible = pos[None, :] <= q_pos[:, None]
        if sliding_window:
            visible &= pos[None, :] > q_pos[:, None] - sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink_col = sinks.double().cpu()[:, None, None].expand(-1, qlen, 1)
            p = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        start += qlen
    return torch.cat(outs) if outs else q_all[:0]
