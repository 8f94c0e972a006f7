"""kernels/fp8.py: e4m3 decode/encode against torch's float8_e4m3fn, the quantization schemes, dequantize, errors."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import fp8


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def test_table_decodes_all_256_codes_like_torch():
    codes = torch.arange(256, dtype=torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()  # torch's own float8_e4m3fn -> float conversion (CPU)
    table = fp8.e4m3_to_float16_table()
    assert table.dtype == torch.float16 and table.shape == (256,)
    assert _same(table.float(), want)
    assert table[0x7F].isnan() and table[0xFF].isnan() and table[0x7E] == 448 and table[0x01] == 2.0 ** -9
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert _same(fp8.e4m3_to_float(codes, dtype).float(), want)
        assert _same(fp8.e4m3_to_float(codes.view(torch.float8_e4m3fn), dtype).float(), want)


def test_encode_is_round_to_nearest_even_and_saturates():
    values = fp8.e4m3_to_float16_table().float()[:0x7F]  # 0 .. 448, finite codes
    mids = (values[1:] + values[:-1]) / 2  # exact ties in float32
    q_mid = fp8.float_to_e4m3(mids).view(torch.uint8).int()
    lower = torch.arange(0x7E, dtype=torch.int32)
    # A tie goes to the even code (even mantissa lsb): lower when lower is even, else upper.
    assert torch.equal(q_mid, torch.where(lower % 2 == 0, lower, lower + 1))
    just_below = torch.nextafter(mids, torch.zeros_like(mids))
    assert torch.equal(fp8.float_to_e4m3(just_below).view(torch.uint8).int(), lower)
    big = torch.tensor([448.0, 460.0, 470.0, 1e6, float("inf"), -1e6])
    assert fp8.float_to_e4m3(big).float().tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0]


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (17, 300), (130, 257)])
def test_quantize_schemes_round_trip_within_half_a_step(shape):
    torch.manual_seed(shape[0])
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[1])
    cases = [
        (fp8.quantize_fp8_per_tensor(x), None, ()),
        (fp8.quantize_fp8_per_row(x), None, (shape[0], 1)),
        (fp8.quantize_fp8_per_group(x, 128), (1, 128), (shape[0], -(-shape[1] // 128))),
        (fp8.quantize_fp8_block(x, (128, 128)), (128, 128), (-(-shape[0] // 128), -(-shape[1] // 128))),
        (fp8.quantize_fp8_block(x, (16, 32)), (16, 32), (-(-shape[0] // 16), -(-shape[1] // 32))),
    ]
    for (q, s), block, scale_shape in cases:
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == scale_shape
        full = s.reshape(()) if s.dim() == 0 else (fp8.expand_block_scales(s, shape, block) if block else s)
        # Every scale maps its set's amax onto 448 exactly (up to float32 rounding), nothing saturates.
        assert float(q.float().abs().max()) == 448.0
        err = (fp8.dequantize_fp8(q, s, block) - x).abs()
        # e4m3 spacing is 2^-3 relative (normal) or 2^-9 absolute (subnormal), in units of the scale.
        bound = torch.maximum(x.abs() * 2.0 ** -4, 2.0 ** -10 * full) * (1 + 1e-6)
        assert bool((err <= bound).all()), float((err / bound).max())


def test_zero_rows_get_a_finite_scale_and_zero_codes():
    q, s = fp8.quantize_fp8_per_row(torch.zeros(2, 5))
    assert torch.equal(s, torch.full((2, 1), fp8.MIN_SCALE)) and bool((q.float() == 0).all())


def test_dequantize_block_with_ragged_edges_matches_the_definition():
    torch.manual_seed(1)
    q = torch.randint(0, 0x7E, (130, 200), dtype=torch.uint8)
    s = torch.rand(2, 2) + 0.5
    got = fp8.dequantize_fp8(q, s, (128, 128))
    vals = q.view(torch.float8_e4m3fn).float()
    assert torch.equal(got[:128, :128], vals[:128, :128] * s[0, 0])
    assert torch.equal(got[128:, 128:], vals[128:, 128:] * s[1, 1])
    assert torch.equal(got[:128, 128:], vals[:128, 128:] * s[0, 1])


def test_reference_w8a8_quantizes_activations_per_token():
    torch.manual_seed(2)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    q, s = fp8.quantize_fp8_per_row(torch.randn(32, 64))
    w = fp8.Fp8Weight(q, s)
    xq, xs = fp8.quantize_fp8_per_row(x)
    want = ((xq.float() * xs) @ (q.float() * s).t()).to(torch.bfloat16)
    assert torch.equal(fp8.fp8_linear_reference(x, w), want)
    want16 = (x.float() @ (q.float() * s).t()).to(torch.bfloat16)
    assert torch.equal(fp8.fp8_linear_reference(x, w, quantize_activations=False), want16)


@pytest.mark.parametrize(("scale_shape", "block", "message"), [
    ((3,), None, "per-channel"),
    ((1, 2), (128, 128), "must be"),
    ((1, 1), (0, 128), "positive"),
])
def test_bad_scales_raise_a_sentence(scale_shape, block, message):
    w = fp8.Fp8Weight(torch.zeros(130, 200, dtype=torch.float8_e4m3fn), torch.ones(scale_shape), block)
    with pytest.raises(ValueError, match=message):
        fp8.weight_scheme(w)


def test_schemes_are_recognised():
    wq = torch.zeros(8, 16, dtype=torch.float8_e4m3fn)
    assert fp8.weight_scheme(fp8.Fp8Weight(wq, torch.ones(()))) == "tensor"
    assert fp8.weight_scheme(fp8.Fp8Weight(wq, torch.ones(1))) == "tensor"
    assert fp8.weight_scheme(fp8.Fp8Weight(wq, torch.ones(8, 1))) == "channel"
    assert fp8.weight_scheme(fp8.Fp8Weight(wq, torch.ones(8))) == "channel"
    assert fp8.weight_scheme(fp8.Fp8Weight(wq, torch.ones(1, 1), (128, 128))) == "block"
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.fp8_bits(torch.zeros(2, dtype=torch.int8))
