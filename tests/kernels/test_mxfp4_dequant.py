"""MXFP4 decode: the Triton kernel (interpreter on CPU) vs the PyTorch module, every code and scale."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.mxfp4 import dequantize_mxfp4
from tokenmill.kernels.triton.mxfp4_dequant import dequantize_mxfp4_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_torch_on_every_byte(dtype):
    g = torch.Generator().manual_seed(0)
    blocks = torch.arange(256, dtype=torch.uint8).view(2, 8, 16)  # every byte: all code pairs
    blocks = torch.cat([blocks, torch.randint(0, 256, (2, 8, 16), generator=g, dtype=torch.uint8)], dim=1)
    scales = torch.randint(100, 150, (2, 16), generator=g, dtype=torch.uint8)
    scales[0, 0], scales[0, 1] = 8, 252  # extremes whose products stay normal in float32 and bfloat16
    ref = dequantize_mxfp4(blocks, scales, torch.float32).to(dtype)
    out = dequantize_mxfp4_triton(blocks.to(DEVICE), scales.to(DEVICE), dtype)
    assert out.shape == (2, 512) and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=0)


def test_triton_writes_into_out_and_checks_shapes():
    blocks = torch.full((3, 2, 16), 0x21, dtype=torch.uint8, device=DEVICE)
    scales = torch.full((3, 2), 127, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(3, 64, device=DEVICE)
    assert dequantize_mxfp4_triton(blocks, scales, torch.float32, out=out) is out
    assert out[:, 0::2].eq(0.5).all() and out[:, 1::2].eq(1.0).all()
    with pytest.raises(ValueError, match="disagree"):
        dequantize_mxfp4_triton(blocks, scales[:, :1], torch.float32)


def test_gpu_scale_byte_check_names_the_tensor_and_range():
    # Mxfp4FusedMoE runs this on CUDA loads: the kernels build 2^(e - 127) from bits, exact for bytes 2..252.
    from tokenmill.layers.fused_moe.mxfp4 import check_gpu_scale_bytes

    check_gpu_scale_bytes("w13_scales", torch.tensor([2, 127, 252], dtype=torch.uint8))
    check_gpu_scale_bytes("w2_scales", torch.empty(0, dtype=torch.uint8))
    for bad in (1, 253, 255):
        with pytest.raises(ValueError, match=rf"w2_scales holds E8M0 scale bytes .*{bad}"):
            check_gpu_scale_bytes("w2_scales", torch.tensor([120, bad], dtype=torch.uint8))
