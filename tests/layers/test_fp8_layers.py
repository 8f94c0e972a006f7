"""FP8 parameters of linear and FusedMoE layers: each simulated tensor-parallel rank loads its slice.

An FP8 layer loaded from full checkpoint-layout tensors (`quantization/fp8.py`'s: fp8 weight, one scale per
output row, [N] or [N, ceil(K / Bk)]) must dequantize to exactly its slice of the full dequantized weight, and
the ranks' weight-only forwards must sum to the unsharded product. 16-bit tensors loaded into an FP8 layer
(`--quantization fp8`, dummy weights) are quantized per row over all of K before any slicing.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels.fp8 import (
    FP8_DTYPE,
    Fp8Weight,
    dequantize_fp8,
    fp8_linear_reference,
    quantize_fp8_block,
    quantize_fp8_per_row,
)
from tokenmill.layers import linear as linear_mod
from tokenmill.layers.fp8_params import Fp8Scheme
from tokenmill.layers.fused_moe import layer as moe_mod

SCHEMES = {"channel-dynamic": Fp8Scheme(None, "dynamic"), "block32-dynamic": Fp8Scheme((32, 32), "dynamic"),
           "channel-weight-only": Fp8Scheme(None, None)}


def _as_rank(monkeypatch, rank, size):
    for mod in (linear_mod, moe_mod):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: size)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def checkpoint_of(w: torch.Tensor, scheme: Fp8Scheme) -> dict[str, torch.Tensor]:
    """Our layout of a dense [N, K] weight: fp8 weight and per-row scales ([N], or block scales repeated per row)."""
    if scheme.block_size is None:
        q, s = quantize_fp8_per_row(w)
        return {"weight": q, "weight_scale": s.reshape(-1)}
    q, s = quantize_fp8_block(w, scheme.block_size)
    return {"weight": q, "weight_scale": s.repeat_interleave(scheme.block_size[0], 0)[:w.shape[0]]}


def dense_of(t: dict[str, torch.Tensor], scheme: Fp8Scheme) -> torch.Tensor:
    return dequantize_fp8(t["weight"], t["weight_scale"], None if scheme.block_k is None else (1, scheme.block_k))


def _load(layer, tensors, *shard):
    for name, t in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, t, *shard)


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("tp", [1, 2])
def test_column_and_row_parallel(monkeypatch, tp, scheme_name):
    """Each rank's forward is the FP8 reference on its slice (W8A8: x quantized per token / per 1 x Bk group
    of its own input), and its dequantized weight is the slice of the full one."""
    scheme = SCHEMES[scheme_name]
    w1, w2, x = _rand(64, 96, seed=1), _rand(40, 64, seed=2), _rand(3, 96, seed=4)
    c1, c2 = checkpoint_of(w1, scheme), checkpoint_of(w2, scheme)
    d1, d2 = dense_of(c1, scheme), dense_of(c2, scheme)
    block = None if scheme.block_k is None else (1, scheme.block_k)
    w8a8 = scheme.activations is not None
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        col, row = linear_mod.ColumnParallelLinear(96, 64), linear_mod.RowParallelLinear(64, 40)
        col.quantize(scheme)
        row.quantize(scheme)
        assert col.weight.dtype == FP8_DTYPE and col.weight.shape == (64 // tp, 96)
        _load(col, c1)
        _load(row, c2)
        rows, cols = slice(rank * 64 // tp, (rank + 1) * 64 // tp), slice(rank * 64 // tp, (rank + 1) * 64 // tp)
        h = col(x)
        assert torch.equal(h, fp8_linear_reference(x, Fp8Weight(c1["weight"][rows], c1["weight_scale"][rows], block),
                                                   None, w8a8))
        k0, kr = rank * 64 // tp, 64 // tp  # this rank's input rows of the row-parallel layer
        scale2 = c2["weight_scale"] if block is None else c2["weight_scale"][:, k0 // 32:-(-(k0 + kr) // 32)]
        assert torch.equal(row.matmul(h, None), fp8_linear_reference(
            h, Fp8Weight(c2["weight"][:, cols].contiguous(), scale2, block), None, w8a8))
        col.dequantize()
        row.dequantize()
        assert col.quant is None and "weight_scale" not in dict(col.named_parameters())
        assert torch.equal(col.weight, d1[rows])
        assert torch.equal(row.weight, d2[:, cols])


def test_qkv_parts_keep_their_scales_and_the_largest_input_scale(monkeypatch):
    """Per-tensor scales of q, k, v (different) become per-row scales of the fused layer; static input scales
    of the parts (one input) collapse to their maximum."""
    _as_rank(monkeypatch, 1, 2)
    qkv = linear_mod.QKVParallelLinear(64, 16, 4, 2)  # rank 1: q heads 2-3, kv head 1
    qkv.quantize(Fp8Scheme(None, "static"))
    full = {}
    for i, (sid, rows) in enumerate((("q", 64), ("k", 32), ("v", 32))):
        w = _rand(rows, 64, seed=10 + i) * (i + 1)
        full[sid] = {"weight": (w / (i + 1)).to(FP8_DTYPE), "weight_scale": torch.full((rows,), float(i + 1)),
                     "input_scale": torch.tensor([0.5 + i])}
        _load(qkv, full[sid], sid)
    assert qkv.input_scale.tolist() == [2.5]
    assert qkv.weight_scale.tolist() == [1.0] * 32 + [2.0] * 16 + [3.0] * 16
    assert torch.equal(qkv.weight[32:48].float(), full["k"]["weight"][16:32].float())


def test_16bit_tensors_are_quantized_per_row_over_all_of_k(monkeypatch):
    """--quantization fp8 on a row-parallel layer: each rank's scales are those of the full rows."""
    w = _rand(8, 64, seed=5)
    q, s = quantize_fp8_per_row(w)
    for rank in range(2):
        _as_rank(monkeypatch, rank, 2)
        row = linear_mod.RowParallelLinear(64, 8)
        row.quantize(Fp8Scheme(None, "dynamic"))
        row.weight.weight_loader(row.weight, w)
        assert torch.equal(row.weight_scale, s.reshape(-1))
        assert torch.equal(row.weight.float(), q[:, rank * 32:(rank + 1) * 32].float())
    _as_rank(monkeypatch, 0, 1)
    merged = linear_mod.MergedColumnParallelLinear(64, [8, 8])
    merged.quantize(Fp8Scheme((16, 32), "dynamic"))
    merged.weight.weight_loader(merged.weight, w, 1)  # the "up" part, block-quantized the scheme's way
    qb, sb = quantize_fp8_block(w, (16, 32))
    assert torch.equal(merged.weight[8:].float(), qb.float()) and torch.equal(merged.weight_scale[8:], sb.expand(8, 2))


def test_row_shard_inside_a_block_is_refused(monkeypatch):
    _as_rank(monkeypatch, 1, 2)
    row = linear_mod.RowParallelLinear(96, 8)  # rank 1 starts at input row 48, inside the 32-wide block 1
    with pytest.raises(ValueError, match="starts at row 48, inside a 32-wide block of the FP8 weight scales"):
        row.quantize(Fp8Scheme((32, 32), "dynamic"))


@pytest.mark.parametrize("scheme_name", ["channel-dynamic", "block32-dynamic"])
def test_fused_moe_experts(monkeypatch, scheme_name):
    """Per-expert gate / up / down FP8 tensors at tp 2: each rank holds its slices, dequantized exactly; the
    forward (experts dequantized, then the 16-bit reference) equals the reference on the dense experts."""
    scheme = SCHEMES[scheme_name]
    e, h, i = 3, 32, 64
    weights = {(x, p): _rand(*(shape), seed=7 * x + len(p)) for x in range(e)
               for p, shape in (("w1", (i, h)), ("w3", (i, h)), ("w2", (h, i)))}
    ckpt = {k: checkpoint_of(w, scheme) for k, w in weights.items()}
    dense = {k: dense_of(c, scheme) for k, c in ckpt.items()}
    x, logits = _rand(5, h, seed=99), _rand(5, e, seed=98)
    total = torch.zeros(5, h)
    for rank in range(2):
        _as_rank(monkeypatch, rank, 2)
        moe = moe_mod.FusedMoE(e, 2, h, i, renormalize=True, reduce_results=False)
        moe.quantize(scheme)
        for (x_id, p), c in ckpt.items():
            for name, t in c.items():
                param = getattr(moe, f"{'w2' if p == 'w2' else 'w13'}_{name}")
                param.weight_loader(param, t, p, x_id)
        total += moe(x, logits)
        moe.dequantize()
        sl = slice(rank * i // 2, (rank + 1) * i // 2)
        for x_id in range(e):
            assert torch.equal(moe.w13_weight[x_id], torch.cat([dense[x_id, "w1"][sl], dense[x_id, "w3"][sl]]))
            assert torch.equal(moe.w2_weight[x_id], dense[x_id, "w2"][:, sl])
    _as_rank(monkeypatch, 0, 1)
    ref = moe_mod.FusedMoE(e, 2, h, i, renormalize=True)
    ref.w13_weight.copy_(torch.stack([torch.cat([dense[x_id, "w1"], dense[x_id, "w3"]]) for x_id in range(e)]))
    ref.w2_weight.copy_(torch.stack([dense[x_id, "w2"] for x_id in range(e)]))
    torch.testing.assert_close(total, ref(x, logits), rtol=1e-4, atol=1e-4)
