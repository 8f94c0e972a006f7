"""tokenmill's one layout for int4/int8 weight-only quantized linear weights, in plain PyTorch.

Every quantized checkpoint format (AWQ, GPTQ, compressed-tensors
pack-quantized) is converted at load into this layout, and every kernel
(Triton on CUDA, the CPU path, the references in tests) reads it. For a
linear layer `y = x W^T` with W of shape [N, K] (out, in; `nn.Linear`'s
orientation), `b` bits (4 or 8), `p = 32 // b` values per int32 and group
size `G` (`G = K` for one group per output channel; checkpoints' -1):

    qweight  int32 [N, ceil(K / p)]   value (n, k) = (qweight[n, k // p] >> (b * (k % p))) & (2^b - 1),
                                      unsigned in [0, 2^b); bits past K are zero
    scales   float [N, ngroups]       ngroups = ceil(K / G); the activation dtype
    qzeros   uint8 [N, ngroups]       unsigned zero points; absent = symmetric (zero = 2^(b-1))
    g_idx    int32 [K]                group of input row k (act-order); absent = k // G

    W[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]

Packing runs along K (the reduction dim), low bits first, in plain order
(no interleave). Keeping N first means a column-parallel shard is a slice
of rows of every tensor, and a row-parallel shard a slice of qweight's
columns (K / p per rank) and of the group columns (K / G per rank).
Fused-MoE experts use the same tensors with a leading expert dim E.

This is the layout GPTQ uses transposed (`qweight [K / p, N]`, packed
along K); compressed-tensors' `weight_packed` is already in it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class QuantTensors(NamedTuple):
    """One quantized weight in tokenmill's layout (see the module docstring); dense or with a leading expert dim.

    qweight int32 [(E,) N, ceil(K / p)]; scales [(E,) N, ngroups]; qzeros uint8 [(E,) N, ngroups] or None;
    g_idx int32 [(E,) K] or None; bits 4 or 8; group_size G or -1; in_features K.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    qzeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int
    in_features: int


def pack_factor(bits: int) -> int:
    """Values per int32 word: 8 for 4-bit, 4 for 8-bit.

    Raises:
        ValueError: bits is not 4 or 8.
    """
    if bits not in (4, 8):
        raise ValueError(f"Quantized weights must have 4 or 8 bits, not {bits}.")
    return 32 // bits


def pack_along_last(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned `bits`-bit integers along the last dim into int32 words, low bits first.

    Args:
        q: integer tensor [..., K] with values in [0, 2^bits).
        bits: 4 or 8.

    Returns:
        int32 [..., ceil(K / p)], p = 32 // bits; a last word that is only
        partly filled has zero high bits.

    Raises:
        ValueError: a value is outside [0, 2^bits), or bits is not 4 or 8.
    """
    p = pack_factor(bits)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) >= 1 << bits):
        raise ValueError(f"Values to pack must lie in [0, {1 << bits}) for {bits}-bit weights.")
    k = q.shape[-1]
    padded = -(-k // p) * p
    v = q.to(torch.int64)
    if padded != k:
        v = torch.nn.functional.pad(v, (0, padded - k))
    v = v.reshape(*q.shape[:-1], padded // p, p)
    shifts = torch.arange(p, device=q.device, dtype=torch.int64) * bits
    words = (v << shifts).sum(dim=-1)  # < 2^32: each value owns its bits
    # Reinterpret the unsigned 32-bit words as int32 (two's complement).
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_along_last(packed: torch.Tensor, bits: int, size: int) -> torch.Tensor:
    """Inverse of `pack_along_last`: int32 [..., W] -> uint8 [..., size] (size <= W * p)."""
    p = pack_factor(bits)
    shifts = torch.arange(p, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * p)[..., :size].to(torch.uint8)


def group_index(in_features: int, group_size: int, g_idx: torch.Tensor | None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """The group of each input row: `g_idx` when given, else `k // group_size` (int64 [K]).

    group_size -1 means one group spanning all of K.
    """
    if g_idx is not None:
        return g_idx.to(torch.int64)
    g = in_features if group_size == -1 else group_size
    return torch.arange(in_features, device=device) // g


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor | None,
               g_idx: torch.Tensor | None, bits: int, group_size: int, in_features: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense weights from tokenmill's layout: `(q - z) * s` per element (the numerical reference).

    Args:
        qweight: int32 [..., N, ceil(K / p)].
        scales: [..., N, ngroups] float.
        qzeros: uint8 [..., N, ngroups] or None (symmetric: 2^(bits-1)).
        g_idx: int32 [..., K] or None (row k is in group k // group_size).
        bits: 4 or 8. group_size: G, or -1 for one group over K.
        in_features: K.
        dtype: result dtype (default scales.dtype). The product is formed
            in float32 and rounded once.

    Returns:
        [..., N, K] in `dtype`.
    """
    q = unpack_along_last(qweight, bits, in_features).to(torch.float32)
    groups = group_index(in_features, group_size, g_idx, device=qweight.device)
    s = scales.to(torch.float32)
    z = torch.full_like(s, float(1 << (bits - 1))) if qzeros is None else qzeros.to(torch.float32)
    if groups.dim() == 1:
        s_k, z_k = s[..., groups], z[..., groups]
    else:  # per-expert g_idx [E, K]: gather each expert's groups
        idx = groups.unsqueeze(-2).expand(*s.shape[:-1], in_features)
        s_k, z_k = torch.gather(s, -1, idx), torch.gather(z, -1, idx)
    return ((q - z_k) * s_k).to(dtype or scales.dtype)


def quantize_reference(w: torch.Tensor, bits: int, group_size: int, symmetric: bool,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of a dense [..., N, K] weight into tokenmill's layout (tests, dummy weights).

    Asymmetric: per group, scale = (max - min) / (2^b - 1), zero =
    round(-min / scale); symmetric: scale = max|w| / (2^(b-1) - 1) with the
    midpoint zero. Returns (qweight, scales in w's dtype, qzeros or None).
    """
    k = w.shape[-1]
    g = k if group_size == -1 else group_size
    ngroups = -(-k // g)
    wf = w.to(torch.float32)
    pad = ngroups * g - k
    wp = torch.nn.functional.pad(wf, (0, pad)) if pad else wf
    wg = wp.reshape(*w.shape[:-1], ngroups, g)
    qmax = (1 << bits) - 1
    if symmetric:
        scale = (wg.abs().amax(-1) / ((1 << (bits - 1)) - 1)).clamp_min(1e-8)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
        scale = ((hi - lo) / qmax).clamp_min(1e-8)
        zero = torch.round(-lo / scale).clamp(0, qmax)
    q = torch.round(wg / scale.unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, qmax)
    q = q.reshape(*w.shape[:-1], ngroups * g)[..., :k].to(torch.uint8)
    qzeros = None if symmetric else zero.to(torch.uint8)
    return pack_along_last(q, bits), scale.to(w.dtype), qzeros
