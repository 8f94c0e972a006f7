"""RotaryEmbedding.forward_cpu (CPU, neox style) against forward_torch, the reference: bit-identical."""

from __future__ import annotations

import pytest
import torch

from tokenmill.layers.rotary import RotaryEmbedding

ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused_qkv", [True, False])
def test_forward_cpu_is_bit_identical_to_forward_torch(monkeypatch, dtype, fused_qkv):
    head, nh, nkv, tokens = 64, 9, 3, 37
    rope = RotaryEmbedding(head, head, 4096, ROPE)
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
    # Adjacent q and k rotate as one tensor: both results live in one new storage.
    same_storage = q_cpu.untyped_storage().data_ptr() == k_cpu.untyped_storage().data_ptr()
    assert same_storage == fused_qkv
    assert q_cpu.untyped_storage().data_ptr() != qkv.untyped_storage().data_ptr()

    def reference_not_expected(*args):
        raise AssertionError("forward took forward_torch on CPU")

    monkeypatch.setattr(rope, "forward_torch", reference_not_expected)
    q_fwd, k_fwd = rope(positions, q, k)  # forward takes forward_cpu on CPU
    assert torch.equal(q_fwd, q_ref) and torch.equal(k_fwd, k_ref)


def test_forward_cpu_takes_3d_inputs_and_position_zero_is_identity():
    rope = RotaryEmbedding(8, 8, 16, ROPE)
    g = torch.Generator().manual_seed(1)
    q, k, positions = torch.randn(3, 2, 8, generator=g), torch.randn(3, 1, 8, generator=g), torch.tensor([0, 5, 9])
    q_out, k_out = rope.forward_cpu(positions, q, k)
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    assert q_out.shape == (3, 2, 8) and k_out.shape == (3, 1, 8)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(q_out[0], q[0]) and torch.equal(k_out[0], k[0])  # position 0: no rotation


@pytest.mark.parametrize("neox, rotary_dim", [(False, 8), (True, 4)])
def test_forward_cpu_refuses_what_it_does_not_handle_and_forward_falls_back(neox, rotary_dim):
    rope = RotaryEmbedding(8, rotary_dim, 16, ROPE, is_neox_style=neox)
    q, k, positions = torch.randn(2, 16), torch.randn(2, 8), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="forward_torch"):
        rope.forward_cpu(positions, q, k)
    q_out, k_out = rope(positions, q, k)
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
