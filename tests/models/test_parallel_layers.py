"""Layer sharding: each simulated tensor-parallel rank loads its slice of full weights.

The tensor-parallel rank/size are patched per rank (no process group); the
ranks' outputs, combined as the collectives would (concatenate for column
layers, sum for row layers), must equal the unsharded layer's output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers import embedding as embedding_mod
from tokenmill.layers import linear as linear_mod
from tokenmill.layers.activation import GeluAndMul, SiluAndMul
from tokenmill.layers.layernorm import RMSNorm
from tokenmill.layers.rotary import compute_inv_freq, get_rope, rope_parameters_from_config


def _as_rank(monkeypatch, rank, size):
    for mod in (linear_mod, embedding_mod):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: size)


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_and_row_parallel(monkeypatch, tp):
    w1, b1, w2, b2, x = _rand(16, 8, seed=1), _rand(16, seed=2), _rand(8, 16, seed=3), _rand(8, seed=4), _rand(3, 8)
    ref = F.linear(F.linear(x, w1, b1), w2, b2)
    total = torch.zeros(3, 8)
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        col = linear_mod.ColumnParallelLinear(8, 16, bias=True)
        row = linear_mod.RowParallelLinear(16, 8, bias=True)
        for layer, w, b in ((col, w1, b1), (row, w2, b2)):
            layer.weight.weight_loader(layer.weight, w)
            layer.bias.weight_loader(layer.bias, b)
        total += F.linear(col(x), row.weight)  # partial sum, as before the all-reduce
    torch.testing.assert_close(total + b2, ref)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qkv_with_kv_head_replication(monkeypatch, tp):
    head, nh, nkv, hidden = 4, 4, 2, 8
    wq, wk, wv, x = _rand(nh * head, hidden, seed=1), _rand(nkv * head, hidden, seed=2), _rand(nkv * head, hidden, seed=3), _rand(2, hidden)
    q_parts, k_parts, v_heads = [], [], set()
    full_v = F.linear(x, wv).view(2, nkv, head)
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        qkv = linear_mod.QKVParallelLinear(hidden, head, nh, nkv)
        for shard_id, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight.weight_loader(qkv.weight, w, shard_id)
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        q_parts.append(q)
        k_parts.append(k)
        # Every value head a rank holds is one of the full layer's heads.
        for h in v.view(2, -1, head).unbind(1):
            matches = [i for i in range(nkv) if torch.allclose(h, full_v[:, i])]
            assert len(matches) == 1
            v_heads.add(matches[0])
    torch.testing.assert_close(torch.cat(q_parts, -1), F.linear(x, wq))
    assert v_heads == set(range(nkv))
    if tp <= nkv:
        torch.testing.assert_close(torch.cat(k_parts, -1), F.linear(x, wk))


@pytest.mark.parametrize("tp", [1, 2])
def test_merged_column_gate_up(monkeypatch, tp):
    wg, wu, x = _rand(12, 8, seed=1), _rand(12, 8, seed=2), _rand(3, 8)
    outs = []
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        layer = linear_mod.MergedColumnParallelLinear(8, [12, 12])
        layer.weight.weight_loader(layer.weight, wg, 0)
        layer.weight.weight_loader(layer.weight, wu, 1)
        outs.append(SiluAndMul()(layer(x)))  # each rank holds [gate_r | up_r]
    torch.testing.assert_close(torch.cat(outs, -1), F.silu(F.linear(x, wg)) * F.linear(x, wu))


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_vocab_parallel_embedding_and_head(monkeypatch, tp):
    vocab, dim = 10, 4  # 10 rows over 3 ranks: 4 + 4 + 2 (+2 zero padding rows)
    table, ids, h = _rand(vocab, dim), torch.tensor([0, 3, 9, 5]), _rand(2, dim)
    emb_sum, logit_parts = torch.zeros(4, dim), []
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        emb = embedding_mod.VocabParallelEmbedding(vocab, dim)
        emb.weight.weight_loader(emb.weight, table)
        in_range = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        local = torch.where(in_range, ids - emb.vocab_start, 0)
        emb_sum += F.embedding(local, emb.weight) * in_range[:, None]
        logit_parts.append(F.linear(h, emb.weight))
    torch.testing.assert_close(emb_sum, table[ids])
    torch.testing.assert_close(torch.cat(logit_parts, -1)[:, :vocab], h @ table.T)


def test_lm_head_tied_shares_storage():
    emb = embedding_mod.VocabParallelEmbedding(10, 4)
    head = embedding_mod.ParallelLMHead(10, 4)
    head.tie_weights(emb)
    assert head.weight is emb.weight
    with torch.no_grad():  # the layers allocate with torch.empty: never test on whatever memory held
        emb.weight.normal_(0.0, 4.0)
    logits = head.compute_logits(torch.ones(2, 4, dtype=emb.weight.dtype), soft_cap=3.0)
    assert logits.dtype == torch.float32 and logits.shape == (2, 10) and logits.abs().max() <= 3.0


def test_rmsnorm_fused_residual_and_gemma():
    x, r = _rand(3, 8, seed=1), _rand(3, 8, seed=2)
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data = _rand(8, seed=3)
    out, new_residual = norm(x, r)
    s = x + r
    torch.testing.assert_close(new_residual, s)
    torch.testing.assert_close(out, s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight)
    gemma = RMSNorm(8, eps=1e-6, gemma=True)
    gemma.weight.data = norm.weight.data - 1
    torch.testing.assert_close(gemma(s), norm(s))


def test_gelu_and_mul():
    x = _rand(2, 6)
    torch.testing.assert_close(GeluAndMul("tanh")(x), F.gelu(x[:, :3], approximate="tanh") * x[:, 3:])


def test_rope_parameters_old_and_new_config_styles():
    new = SimpleNamespace(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    old = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    plain = SimpleNamespace(rope_theta=1e4, rope_scaling=None)
    per_layer = SimpleNamespace(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    assert rope_parameters_from_config(new)["rope_type"] == "llama3"
    assert rope_parameters_from_config(old) == {"type": "linear", "factor": 2.0, "rope_theta": 5e5, "rope_type": "linear"}
    assert rope_parameters_from_config(plain) == {"rope_theta": 1e4, "rope_type": "default"}
    assert rope_parameters_from_config(per_layer)["rope_theta"] == 1e6
    assert rope_parameters_from_config(per_layer, "sliding_attention")["rope_theta"] == 1e4
    with pytest.raises(ValueError, match="longrope"):
        compute_inv_freq(8, {"rope_type": "longrope", "rope_theta": 1e4})


def test_rope_neox_rotation_preserves_norm_and_is_relative():
    rope = get_rope(8, 64, {"rope_type": "default", "rope_theta": 10000.0})
    q, k = _rand(1, 8, seed=1), _rand(1, 8, seed=2)
    scores = []
    for p in (3, 10):  # the same offset (2) at two absolute positions
        qr, _ = rope(torch.tensor([p + 2]), q, k)
        _, kr = rope(torch.tensor([p]), q, k)
        scores.append((qr * kr).sum())
    torch.testing.assert_close(scores[0], scores[1])
    qr, _ = rope(torch.tensor([5]), q, k)
    torch.testing.assert_close(qr.norm(), q.norm())
    assert get_rope(8, 64, {"rope_type": "default", "rope_theta": 10000.0}) is rope
