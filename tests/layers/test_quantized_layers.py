"""int4/int8 parameters of linear and FusedMoE layers: each simulated tensor-parallel rank loads its slice.

A quantized layer loaded from full quantized tensors and then dequantized
must hold exactly the weight a dense layer of the same rank loads from the
full dequantized tensor (same formula, same float32 products); the ranks'
forward passes (CPU reference path) combine into the unsharded output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.kernels.quant_pack import dequantize, pack_along_last, quantize_reference, unpack_along_last
from tokenmill.layers import linear as linear_mod
from tokenmill.layers.fused_moe import layer as moe_mod
from tokenmill.layers.quant_params import QuantScheme

SCHEMES = {
    "int4-g16-zeros": QuantScheme(4, 16, True, False),
    "int4-g16-actorder": QuantScheme(4, 16, True, True),
    "int8-channel-sym": QuantScheme(8, -1, False, False),
    "int4-g24-sym": QuantScheme(4, 24, False, False),  # row shards of 48 at tp=4 start inside a group
}


def _as_rank(monkeypatch, rank, size):
    for mod in (linear_mod, moe_mod):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: size)


def quantize_full(w: torch.Tensor, scheme: QuantScheme, seed: int = 0) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (our layout) of a dense [..., N, K] weight; act-order groups from a random permutation."""
    k = w.shape[-1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if scheme.act_order else torch.arange(k)
    qw, scales, zeros = quantize_reference(w[..., perm], scheme.bits, scheme.group_size, not scheme.has_zeros)
    q = torch.empty(*w.shape[:-1], k, dtype=torch.uint8)
    q[..., perm] = unpack_along_last(qw, scheme.bits, k)  # back to the original row order
    out = {"qweight": pack_along_last(q, scheme.bits), "scales": scales}
    if zeros is not None:
        out["qzeros"] = zeros
    if scheme.act_order:
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // scheme.group_size).to(torch.int32)
        out["g_idx"] = g_idx.expand(*w.shape[:-2], k).contiguous()
    return out


def dense_of(t: dict[str, torch.Tensor], scheme: QuantScheme, k: int) -> torch.Tensor:
    return dequantize(t["qweight"], t["scales"], t.get("qzeros"), t.get("g_idx"), scheme.bits, scheme.group_size, k)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _load(layer, tensors: dict[str, torch.Tensor], *shard):
    for kind, t in tensors.items():
        param = getattr(layer, kind)
        param.weight_loader(param, t, *shard)


@pytest.mark.parametrize("scheme_name", list(SCHEMES))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_parallel(monkeypatch, tp, scheme_name):
    scheme = SCHEMES[scheme_name]
    # column 192 -> 32, row 32 -> 48 (row shards of 8 rows: inside a group of 16 or 24 at tp 4)
    w1, w2, b2, x = _rand(32, 192, seed=1), _rand(48, 32, seed=2), _rand(48, seed=3), _rand(3, 192, seed=4)
    q1, q2 = quantize_full(w1, scheme, 1), quantize_full(w2, scheme, 2)
    d1, d2 = dense_of(q1, scheme, 192), dense_of(q2, scheme, 32)
    ref = F.linear(F.linear(x, d1), d2, b2)
    total = torch.zeros(3, 48)
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        col = linear_mod.ColumnParallelLinear(192, 32)
        row = linear_mod.RowParallelLinear(32, 48, bias=True)
        dense_col, dense_row = linear_mod.ColumnParallelLinear(192, 32), linear_mod.RowParallelLinear(32, 48)
        col.quantize(scheme)
        row.quantize(scheme)
        assert col.weight is None and "weight" not in dict(col.named_parameters())
        _load(col, q1)
        _load(row, q2)
        row.bias.weight_loader(row.bias, b2)
        partial = row.matmul(col(x), None)  # CPU reference path of a quantized layer
        total += partial
        dense_col.weight.weight_loader(dense_col.weight, d1)
        dense_row.weight.weight_loader(dense_row.weight, d2)
        col.dequantize()
        row.dequantize()
        assert col.quant is None and "qweight" not in dict(col.named_parameters())
        assert torch.equal(col.weight, dense_col.weight)
        assert torch.equal(row.weight, dense_row.weight)
    torch.testing.assert_close(total + b2, ref, rtol=1e-4, atol=1e-4)


def test_row_shard_inside_a_group_synthesizes_g_idx(monkeypatch):
    # K = 96, G = 32, tp = 2: rank 1 starts at row 48, inside group 1; it keeps groups 1 and 2.
    scheme = QuantScheme(4, 32, True, False)
    w = _rand(8, 96, seed=7)
    q = quantize_full(w, scheme)
    dense = dense_of(q, scheme, 96)
    _as_rank(monkeypatch, 1, 2)
    row = linear_mod.RowParallelLinear(96, 8)
    row.quantize(scheme)
    assert row.scales.shape == (8, 2)
    assert "g_idx" not in dict(row.named_parameters())  # a buffer, not a checkpoint tensor
    assert row.g_idx.tolist() == [0] * 16 + [1] * 32
    _load(row, q)
    row.dequantize()
    assert torch.equal(row.weight, dense[:, 48:])


def test_row_shard_inside_a_packed_word_is_refused(monkeypatch):
    _as_rank(monkeypatch, 1, 2)
    row = linear_mod.RowParallelLinear(24, 8)  # rank 1 starts at row 12, inside an int32 word of 8 4-bit values
    with pytest.raises(ValueError, match="packed int32 word"):
        row.quantize(QuantScheme(4, -1, False, False))


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_and_qkv_parts(monkeypatch, tp):
    scheme = SCHEMES["int4-g16-actorder"]
    gate, up, x = _rand(32, 64, seed=1), _rand(32, 64, seed=2), _rand(2, 64)
    wq, wk, wv = _rand(32, 64, seed=3), _rand(16, 64, seed=4), _rand(16, 64, seed=5)
    # Parts of one fused layer share their input, hence one act-order permutation (seed 9).
    parts = {n: quantize_full(w, scheme, seed=9) for n, w in
             (("gate", gate), ("up", up), ("q", wq), ("k", wk), ("v", wv))}
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        merged = linear_mod.MergedColumnParallelLinear(64, [32, 32])
        qkv = linear_mod.QKVParallelLinear(64, 8, 4, 2)
        dense_m = linear_mod.MergedColumnParallelLinear(64, [32, 32])
        dense_qkv = linear_mod.QKVParallelLinear(64, 8, 4, 2)
        merged.quantize(scheme)
        qkv.quantize(scheme)
        for i, name in enumerate(("gate", "up")):
            _load(merged, parts[name], i)
            dense_m.weight.weight_loader(dense_m.weight, dense_of(parts[name], scheme, 64), i)
        for name in ("q", "k", "v"):
            _load(qkv, parts[name], name)
            dense_qkv.weight.weight_loader(dense_qkv.weight, dense_of(parts[name], scheme, 64), name)
        torch.testing.assert_close(merged(x), dense_m(x), rtol=1e-5, atol=1e-5)
        merged.dequantize()
        qkv.dequantize()
        assert torch.equal(merged.weight, dense_m.weight)
        assert torch.equal(qkv.weight, dense_qkv.weight)


def test_fused_parts_with_different_g_idx_are_refused(monkeypatch):
    scheme = SCHEMES["int4-g16-actorder"]
    _as_rank(monkeypatch, 0, 1)
    merged = linear_mod.MergedColumnParallelLinear(64, [32, 32])
    merged.quantize(scheme)
    _load(merged, quantize_full(_rand(32, 64, seed=1), scheme, seed=1), 0)
    with pytest.raises(ValueError, match="different act-order g_idx"):
        _load(merged, quantize_full(_rand(32, 64, seed=2), scheme, seed=2), 1)


def _expert_params(moe) -> dict:
    """The FusedMoE's parameters as a model at `m.experts` names them."""
    return {f"m.experts.{name}": p for name, p in moe.named_parameters()}


@pytest.mark.parametrize("scheme_name", ["int4-g16-zeros", "int4-g16-actorder", "int8-channel-sym"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_moe_per_expert(monkeypatch, tp, scheme_name):
    scheme = SCHEMES[scheme_name]
    e, h, inter = 3, 32, 64
    gates, ups, downs = _rand(e, inter, h, seed=1), _rand(e, inter, h, seed=2), _rand(e, h, inter, seed=3)
    x, logits = _rand(5, h, seed=4), _rand(5, e, seed=5)
    ref_out = torch.zeros(5, h)
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        moe = moe_mod.FusedMoE(e, 2, h, inter, renormalize=True, reduce_results=False)
        dense = moe_mod.FusedMoE(e, 2, h, inter, renormalize=True, reduce_results=False)
        moe.quantize(scheme)
        params, dense_params = _expert_params(moe), _expert_params(dense)
        for j in range(e):
            for proj, w, seed in (("gate_proj", gates[j], 10 + j), ("up_proj", ups[j], 10 + j),
                                  ("down_proj", downs[j], 20 + j)):
                q = quantize_full(w, scheme, seed)
                for kind, t in q.items():
                    assert moe_mod.load_expert_weight(params, f"m.experts.{j}.{proj}.{kind}", t) is not None
                moe_mod.load_expert_weight(dense_params, f"m.experts.{j}.{proj}.weight",
                                           dense_of(q, scheme, w.shape[1]))
        out = moe(x, logits)
        torch.testing.assert_close(out, dense(x, logits), rtol=1e-5, atol=1e-5)
        ref_out += out
        moe.dequantize()
        assert torch.equal(moe.w13_weight, dense.w13_weight) and torch.equal(moe.w2_weight, dense.w2_weight)
    if tp == 2:  # partial sums of the ranks = the unsharded block
        _as_rank(monkeypatch, 0, 1)
        full = moe_mod.FusedMoE(e, 2, h, inter, renormalize=True)
        params = _expert_params(full)
        for j in range(e):
            for proj, w, seed in (("gate_proj", gates[j], 10 + j), ("up_proj", ups[j], 10 + j),
                                  ("down_proj", downs[j], 20 + j)):
                moe_mod.load_expert_weight(params, f"m.experts.{j}.{proj}.weight",
                                           dense_of(quantize_full(w, scheme, seed), scheme, w.shape[1]))
        torch.testing.assert_close(ref_out, full(x, logits), rtol=1e-4, atol=1e-4)


def test_expert_shape_error_names_the_tensor(monkeypatch):
    _as_rank(monkeypatch, 0, 1)
    moe = moe_mod.FusedMoE(2, 1, 32, 64, renormalize=False)
    moe.quantize(SCHEMES["int4-g16-zeros"])
    with pytest.raises(ValueError, match=r"experts\.1\.down_proj\.scales"):
        moe_mod.load_expert_weight(_expert_params(moe), "m.experts.1.down_proj.scales", torch.ones(32, 3))


def test_experts_with_biases_refuse_int4_quantization():
    # gpt-oss experts carry biases; the quantized grouped kernel has no bias terms, so quantizing them
    # (e.g. --load-format dummy --quantization gptq on a gpt-oss config) must fail, not drop the biases.
    moe = moe_mod.FusedMoE(4, 2, 64, 128, renormalize=True, activation="swigluoai", has_bias=True)
    with pytest.raises(ValueError, match="biases"):
        moe.quantize(QuantScheme(4, 32, False, False))
    assert moe.quant is None and moe.w13_weight is not None  # nothing was replaced
