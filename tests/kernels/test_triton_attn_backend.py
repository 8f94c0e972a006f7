"""TritonAttentionBackend.forward: KV write then attention, against the reference."""

from __future__ import annotations

import numpy as np
import torch
from attention_reference import make_paged_batch, reference_attention

from tokenmill.attention.backends.triton_attn import TritonAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_forward_writes_new_kv_then_attends():
    gen = torch.Generator().manual_seed(7)
    ctx, q = [0, 18, 40], [6, 1, 3]
    num_pad = 2
    batch = make_paged_batch(ctx, q, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                             dtype=torch.float32, device=DEVICE, num_padding_tokens=num_pad, generator=gen)
    block_size = 16
    # Slots of the new tokens; then poison them so only the backend's KV write can fill them.
    slots = []
    for i, (c, n) in enumerate(zip(ctx, q, strict=True)):
        for p in range(c, c + n):
            slots.append(int(batch.block_table[i, p // block_size]) * block_size + p % block_size)
    slot_mapping = torch.tensor(slots + [-1] * num_pad, dtype=torch.int64, device=DEVICE)
    flat = batch.kv_cache.view(2, -1, 2, 16)
    new_k = flat[0, slot_mapping[:-num_pad]].clone()
    new_v = flat[1, slot_mapping[:-num_pad]].clone()
    expected_cache = batch.kv_cache.clone()
    flat[:, slot_mapping[:-num_pad]] = float("nan")
    pad_kv = torch.randn(num_pad, 2, 16, generator=gen).to(DEVICE)
    key, value = torch.cat([new_k, pad_kv]), torch.cat([new_v, pad_kv])

    qsl = np.array([0, 6, 7, 10], dtype=np.int32)
    md = AttentionMetadata(
        num_actual_tokens=10, num_reqs=3, max_query_len=6, max_seq_len=43,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, block_table=batch.block_table,
        slot_mapping=slot_mapping, query_start_loc_cpu=qsl, seq_lens_cpu=batch.seq_lens.cpu().numpy(),
    )
    backend = TritonAttentionBackend()
    assert backend.name == "TRITON_ATTN"
    out = backend.forward(batch.query, key, value, batch.kv_cache, md, scale=0.25)

    assert out.shape == batch.query.shape
    # The cache now equals the original (padding tokens wrote nothing; NaN compares unequal, so mask it).
    same = (batch.kv_cache == expected_cache) | (torch.isnan(batch.kv_cache) & torch.isnan(expected_cache))
    assert same.all()
    ref = reference_attention(batch, scale=0.25)
    assert (out[:10].double().cpu() - ref).abs().max() < 2e-5
    assert torch.all(out[10:] == 0)
