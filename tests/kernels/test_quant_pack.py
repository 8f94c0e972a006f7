"""tokenmill's int4/int8 layout helpers (`kernels/quant_pack.py`) against direct formulas."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import quant_pack as qp


@pytest.mark.parametrize("bits,k", [(4, 8), (4, 13), (8, 4), (8, 7), (4, 1)])
def test_pack_is_low_bits_first_and_round_trips(bits, k):
    q = torch.randint(0, 1 << bits, (3, 5, k), generator=torch.Generator().manual_seed(k))
    packed = qp.pack_along_last(q, bits)
    p = 32 // bits
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, -(-k // p))
    # Direct formula on the unsigned word: value j of word w sits at bits [j*b, (j+1)*b).
    words = packed.to(torch.int64) & 0xFFFFFFFF
    for kk in range(k):
        assert torch.equal((words[..., kk // p] >> (bits * (kk % p))) & ((1 << bits) - 1), q[..., kk])
    # Bits past K are zero.
    if k % p:
        assert torch.all(words[..., -1] >> (bits * (k % p)) == 0)
    assert torch.equal(qp.unpack_along_last(packed, bits, k), q.to(torch.uint8))


def test_pack_sets_the_sign_bit_for_high_top_values():
    assert qp.pack_along_last(torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15]]), 4).tolist() == [[-(1 << 28)]]
    assert qp.pack_along_last(torch.tensor([[1, 2, 3, 4]]), 8).tolist() == [[0x04030201]]


def test_pack_rejects_out_of_range_and_bad_bits():
    with pytest.raises(ValueError, match="must lie in"):
        qp.pack_along_last(torch.tensor([[16]]), 4)
    with pytest.raises(ValueError, match="4 or 8 bits"):
        qp.pack_factor(3)


def test_group_index():
    assert qp.group_index(5, 2, None).tolist() == [0, 0, 1, 1, 2]
    assert qp.group_index(5, -1, None).tolist() == [0] * 5
    assert qp.group_index(3, 2, torch.tensor([1, 0, 1], dtype=torch.int32)).tolist() == [1, 0, 1]


@pytest.mark.parametrize("zeros", [True, False])
def test_dequantize_matches_elementwise_formula_with_per_expert_g_idx(zeros):
    g = torch.Generator().manual_seed(0)
    e, n, k, bits = 2, 3, 10, 4
    q = torch.randint(0, 16, (e, n, k), generator=g)
    scales = torch.rand(e, n, 3, generator=g)
    qzeros = torch.randint(0, 16, (e, n, 3), generator=g).to(torch.uint8) if zeros else None
    g_idx = torch.stack([torch.randint(0, 3, (k,), generator=g) for _ in range(e)]).to(torch.int32)
    out = qp.dequantize(qp.pack_along_last(q, bits), scales, qzeros, g_idx, bits, 4, k)
    for ee in range(e):
        for nn in range(n):
            for kk in range(k):
                grp = int(g_idx[ee, kk])
                z = float(qzeros[ee, nn, grp]) if zeros else 8.0
                assert out[ee, nn, kk].item() == pytest.approx((float(q[ee, nn, kk]) - z) * float(scales[ee, nn, grp]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, -1])
def test_quantize_reference_error_is_within_half_a_step(bits, symmetric, group_size):
    w = torch.randn(6, 80, generator=torch.Generator().manual_seed(1))
    qweight, scales, qzeros = qp.quantize_reference(w, bits, group_size, symmetric)
    assert (qzeros is None) == symmetric
    back = qp.dequantize(qweight, scales, qzeros, None, bits, group_size, 80)
    step = scales[:, qp.group_index(80, group_size, None)]
    assert torch.all((back - w).abs() <= step * 0.5 + 1e-6)
