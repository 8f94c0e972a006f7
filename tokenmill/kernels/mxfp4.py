"""MXFP4 weights: decode (and, for tests and dummy weights, encode) in PyTorch.

MXFP4 is the OCP Microscaling format (OCP "Microscaling Formats (MX)
Specification" v1.0, 2023, sections 5.3 and 6.3): blocks of 32 values share
one E8M0 scale (an 8-bit power of two, 2^(s - 127); 255 is NaN) and each
value is an FP4 E2M1 element (1 sign, 2 exponent, 1 mantissa bit):

    code  0    1    2    3    4    5    6    7     (8-15: the same, negative)
    value 0   0.5  1.0  1.5  2.0  3.0  4.0  6.0

gpt-oss checkpoints store a weight [..., rows, cols] as `*_blocks` uint8
[..., rows, cols / 32, 16] (two codes per byte, the LOW nibble first, i.e.
element 2j in bits 0-3 and 2j+1 in bits 4-7) and `*_scales` uint8
[..., rows, cols / 32]; rows are the output features, cols the input
features (nn.Linear's [out, in]). This layout is read from the published
checkpoints and transformers' `integrations/mxfp4.py`; the code is ours.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per E8M0 scale
_E8M0_BIAS = 127
_E2M1_EMAX = 2  # exponent of E2M1's largest normal, 6 = 1.5 * 2^2 (the spec's emax_elem)


def check_mxfp4_shapes(blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    """Raise ValueError unless `blocks`/`scales` encode a weight of `shape` ([..., rows, cols]).

    Expected: blocks [..., rows, cols / 32, 16] uint8, scales [..., rows, cols / 32] uint8.
    """
    *lead, cols = shape
    want_blocks, want_scales = (*lead, cols // BLOCK, BLOCK // 2), (*lead, cols // BLOCK)
    if cols % BLOCK or tuple(blocks.shape) != want_blocks or tuple(scales.shape) != want_scales:
        raise ValueError(f"MXFP4 tensors of {name} have blocks {tuple(blocks.shape)} and scales "
                         f"{tuple(scales.shape)}, but the config implies blocks {want_blocks} and scales "
                         f"{want_scales} for a weight of shape {tuple(shape)}.")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight encoded by `blocks` [..., G, 16] uint8 and `scales` [..., G] uint8 as [..., G * 32] `dtype`.

    Exact: every E2M1 value times a power of two is representable in float32
    and, for scales in bfloat16's exponent range, in bfloat16 (float16 can
    overflow or flush for extreme scales; the product is formed in float32).
    Runs on the tensors' device, chunked over the leading dim to bound the
    float32 temporary.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} disagree "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G]).")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty(*blocks.shape[:-1], BLOCK, dtype=dtype, device=blocks.device)
    flat_b = blocks.reshape(-1, *blocks.shape[-2:])
    flat_s = scales.reshape(-1, scales.shape[-1])
    flat_o = out.view(-1, *out.shape[-2:])
    step = max(1, (1 << 24) // max(1, flat_o[0].numel()))
    for i in range(0, flat_b.shape[0], step):
        b = flat_b[i:i + step].to(torch.int64)
        # byte j holds elements 2j (low nibble) and 2j + 1 (high nibble): [.., 16] -> [.., 16, 2] -> [.., 32]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(-2)
        exp = flat_s[i:i + step].to(torch.int32) - _E8M0_BIAS
        flat_o[i:i + step] = torch.ldexp(lut[codes], exp[..., None].float()).to(dtype)
    return out.flatten(-2)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode `weight` [..., cols] (cols a multiple of 32) as MXFP4 (blocks, scales) in the layout above.

    Scale of a block: 2^(floor(log2(amax)) - 2) (OCP MX 6.3), so the largest
    magnitude maps into [4, 8) and values round to the nearest E2M1 code
    (ties to the smaller magnitude), saturating at +-6; an all-zero block gets scale
    2^-127. For tests and dummy weights; not a tuned quantizer.
    """
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got {weight.shape[-1]}.")
    w = weight.float().reshape(*weight.shape[:-1], -1, BLOCK)
    amax = w.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-126))) - _E2M1_EMAX,
                      torch.full_like(amax, -_E8M0_BIAS)).clamp(-_E8M0_BIAS, _E8M0_BIAS)
    x = w / torch.exp2(exp)[..., None]
    mags = torch.tensor(E2M1_VALUES[:8], device=w.device)
    # Nearest magnitude (argmin takes the first, smaller one on a tie); past 6 everything saturates to code 7.
    codes = (x.abs()[..., None] - mags).abs().argmin(dim=-1)
    codes = codes + 8 * (x < 0).to(codes.dtype)
    codes = codes.to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exp + _E8M0_BIAS).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()
