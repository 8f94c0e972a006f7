"""Random int4/int8 weights in tokenmill's quantized layout (`kernels/quant_pack.py`) for the kernel tests.

The packed values, scales and zero points are drawn directly (not quantized
from a dense matrix), so every code in [0, 2^bits) and every zero point
occurs; the reference is `quant_pack.dequantize` of the same tensors.
"""

from __future__ import annotations

import torch

from tokenmill.kernels.quant_pack import QuantTensors, dequantize, pack_along_last


def random_quant(n: int, k: int, bits: int, group_size: int, zeros: bool, act_order: bool,
                 dtype: torch.dtype = torch.float32, experts: int | None = None, seed: int = 0,
                 device: str = "cpu") -> QuantTensors:
    """A random weight W [(E,) n, k]: q uniform in [0, 2^bits), scales ~ U[0.5, 1.5] / (2^bits * sqrt(k)),
    zero points uniform (or absent), act-order g_idx a shuffle of k // G (per expert when experts)."""
    g = torch.Generator(device=device).manual_seed(seed)  # made on the device: fast at GPU test sizes
    lead = () if experts is None else (experts,)
    gs = k if group_size == -1 else group_size
    ngroups = -(-k // gs)
    q = torch.randint(0, 1 << bits, (*lead, n, k), generator=g, device=device)
    scales = (torch.rand(*lead, n, ngroups, generator=g, device=device) + 0.5) / ((1 << bits) * k**0.5) * 4
    qzeros = None
    if zeros:
        qzeros = torch.randint(0, 1 << bits, (*lead, n, ngroups), generator=g, device=device).to(torch.uint8)
    g_idx = None
    if act_order:
        base = torch.arange(k, device=device) // gs
        rows = [base[torch.randperm(k, generator=g, device=device)] for _ in range(experts or 1)]
        g_idx = (torch.stack(rows) if experts is not None else rows[0]).to(torch.int32)
    return QuantTensors(pack_along_last(q, bits), scales.to(dtype), qzeros, g_idx, bits, group_size, k)


def dense(w: QuantTensors, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reference dense weight of `w` (quant_pack.dequantize)."""
    return dequantize(w.qweight, w.scales, w.qzeros, w.g_idx, w.bits, w.group_size, w.in_features, dtype)


def row_shard(w: QuantTensors, rank: int, world: int) -> QuantTensors:
    """A row-parallel (input-dim) shard as the weight loaders cut it, as strided views: qweight columns K/p per
    rank and group columns K/G per rank; act-order keeps every group and slices g_idx."""
    p = 32 // w.bits
    k = w.in_features // world
    assert k % p == 0
    words = slice(rank * k // p, (rank + 1) * k // p)
    if w.g_idx is not None:
        return QuantTensors(w.qweight[..., words], w.scales, w.qzeros, w.g_idx[..., rank * k:(rank + 1) * k],
                            w.bits, w.group_size, k)
    assert w.group_size != -1 and k % w.group_size == 0
    groups = slice(rank * k // w.group_size, (rank + 1) * k // w.group_size)
    return QuantTensors(w.qweight[..., words], w.scales[..., groups],
                        w.qzeros[..., groups] if w.qzeros is not None else None, None, w.bits, w.group_size, k)


def column_shard(w: QuantTensors, rank: int, world: int) -> QuantTensors:
    """A column-parallel (output-dim) shard: a slice of the rows of every tensor."""
    n = w.qweight.shape[-2] // world
    rows = slice(rank * n, (rank + 1) * n)
    return QuantTensors(w.qweight[..., rows, :], w.scales[..., rows, :],
                        w.qzeros[..., rows, :] if w.qzeros is not None else None, w.g_idx, w.bits, w.group_size,
                        w.in_features)
