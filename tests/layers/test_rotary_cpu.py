"""RotaryEmbedding.forward_cpu (CPU, neox style) against forward_torch, the reference: bit-identical."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused_qkv", [True, False])
def test_forward_cpu_is_bit_identical_to_forward_torch(dtype, fused_qkv):
    head, nh, nkv, tokens = 64, 9, 3, 37
    rope = RotaryEmbedding(head, head, 4096, {"rope_type": "default", "rope_theta": 10000.0})
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = torch.randn(tokens, (nh + 2 * nkv) * head, generator=g).to(dtype)
    if fused_qkv:  # q and k are adjacent row-strided views of one buffer, as the models split qkv
        q, k, _ = qkv.split([nh * head, nkv * head, nkv * head], dim=-1)
    else:
        q, k = qkv[:, : nh * head].clone(), qkv[:, nh * head : (nh + nkv) * head].clone()
    before = qkv.clone()
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    q_cpu, k_cpu = rope.forward_cpu(positions, q, k)
    assert q_cpu.shape == q.shape and k_cpu.shape == k.shape and q_cpu.dtype == dtype
    assert torch.equal(q_cpu, q_ref) and torch.equal(k_cpu, k_ref)
    assert torch.equal(qkv, before)  # inputs are not modified
    assert not torch.equal(q_cpu, q)  # it did rotate
    assert torch.equal(rope(positions, q, k)[0], q_ref)  # forward takes this path on CPU


def test_forward_cpu_position_zero_is_identity():
    rope = RotaryEmbedding(8, 8, 16, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = torch.randn(1, 16), torch.randn(1, 8)
    q_out, k_out = rope.forward_cpu(torch.zeros(1, dtype=torch.long), q, k)
    assert torch.equal(q_out, q) and torch.equal(k_out, k)
