"""weight_loader sharding on simulated ranks: uneven QKV + o_proj, vocab padding, dummy weights at any tp.

Ranks are simulated by patching the tensor-parallel rank/size the layers
read (no process group). Outputs are combined as the collectives would:
column shards concatenated, row partial sums added.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers import embedding as embedding_mod
from tokenmill.layers import linear as linear_mod
from tokenmill.model_loader.dummy import initialize_dummy_weights


def _as_rank(monkeypatch, rank: int, size: int) -> None:
    for mod in (linear_mod, embedding_mod):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: size)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _attention_heads_out(q, k, v, nh, nkv, head):
    """Per-token attention with no mixing across tokens: softmax over heads' own q.k (a stand-in
    that still needs every query head paired with its own KV head)."""
    q = q.view(-1, nh, head)
    k = k.view(-1, nkv, head).repeat_interleave(nh // nkv, dim=1)
    v = v.view(-1, nkv, head).repeat_interleave(nh // nkv, dim=1)
    return (torch.sigmoid((q * k).sum(-1, keepdim=True)) * v).reshape(q.shape[0], -1)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_uneven_qkv_and_o_proj_match_full_attention_block(monkeypatch, tp):
    head, nh, nkv, hidden = 4, 9, 3, 12
    wq, wk, wv = _rand(nh * head, hidden, seed=1), _rand(nkv * head, hidden, seed=2), _rand(nkv * head, hidden, seed=3)
    wo, bq, x = _rand(hidden, nh * head, seed=4), _rand(nh * head, seed=5), _rand(5, hidden, seed=6)
    ref = F.linear(_attention_heads_out(F.linear(x, wq, bq), F.linear(x, wk), F.linear(x, wv), nh, nkv, head), wo)
    total = torch.zeros_like(ref)
    sizes = []
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        qkv = linear_mod.QKVParallelLinear(hidden, head, nh, nkv, bias=True)
        for shard_id, w in (("q", wq), ("k", wk), ("v", wv)):
            qkv.weight.weight_loader(qkv.weight, w, shard_id)
        full_bias = torch.cat([bq, torch.zeros(2 * nkv * head)])
        qkv.bias.weight_loader(qkv.bias, full_bias)  # the fused [q; k; v] form
        p = qkv.partition
        o_proj = linear_mod.RowParallelLinear(nh * head, hidden, input_partition=(p.q_start * head, p.num_heads * head))
        o_proj.weight.weight_loader(o_proj.weight, wo)
        q, k, v = qkv(x).split([qkv.q_size, qkv.kv_size, qkv.kv_size], dim=-1)
        total += F.linear(_attention_heads_out(q, k, v, qkv.num_heads, qkv.num_kv_heads, head), o_proj.weight)
        sizes.append(qkv.num_heads)
    torch.testing.assert_close(total, ref)
    assert sum(sizes) == nh
    if tp == 2:
        assert sizes == [6, 3]


def test_fused_qkv_full_tensor_equals_separate_parts(monkeypatch):
    head, nh, nkv, hidden = 2, 9, 3, 4
    full = _rand((nh + 2 * nkv) * head, hidden, seed=7)
    q, k, v = full.split([nh * head, nkv * head, nkv * head])
    _as_rank(monkeypatch, 1, 2)
    a = linear_mod.QKVParallelLinear(hidden, head, nh, nkv)
    b = linear_mod.QKVParallelLinear(hidden, head, nh, nkv)
    a.weight.weight_loader(a.weight, full)
    for sid, part in (("q", q), ("k", k), ("v", v)):
        b.weight.weight_loader(b.weight, part, sid)
    assert torch.equal(a.weight, b.weight)
    assert a.weight.full_shape == tuple(full.shape)


@pytest.mark.parametrize("tp", [2, 3])
def test_vocab_parallel_embedding_and_head_with_padding(monkeypatch, tp):
    vocab, hidden = 10, 4  # 10 rows over 3 ranks -> 4, 4, 2 (+2 zero rows)
    table, ids, h = _rand(vocab, hidden, seed=1), torch.tensor([0, 3, 4, 9, 7]), _rand(2, hidden, seed=2)
    emb_sum = torch.zeros(len(ids), hidden)
    logits = []
    for rank in range(tp):
        _as_rank(monkeypatch, rank, tp)
        emb = embedding_mod.VocabParallelEmbedding(vocab, hidden)
        emb.weight.weight_loader(emb.weight, table)
        in_range = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        local = F.embedding(torch.where(in_range, ids - emb.vocab_start, 0), emb.weight) * in_range[:, None]
        emb_sum += local
        logits.append(F.linear(h, emb.weight))
    torch.testing.assert_close(emb_sum, F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], F.linear(h, table))
    assert torch.all(torch.cat(logits, -1)[:, vocab:] == 0)


class _TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = embedding_mod.VocabParallelEmbedding(10, 8)
        self.qkv = linear_mod.QKVParallelLinear(8, 2, 6, 2)
        self.up = linear_mod.MergedColumnParallelLinear(8, [6, 6])
        self.down = linear_mod.RowParallelLinear(6, 8)


def test_dummy_weights_are_the_same_model_at_any_tp(monkeypatch):
    """Each rank's dummy shard equals the matching slice of the tp=1 dummy weights."""
    _as_rank(monkeypatch, 0, 1)
    full = _TinyBlock()
    initialize_dummy_weights(full, seed=3)
    for rank in range(2):
        _as_rank(monkeypatch, rank, 2)
        shard = _TinyBlock()
        initialize_dummy_weights(shard, seed=3)
        ref = _TinyBlock()  # the tp=2 layer loaded from the tp=1 tensors
        for (name, p_ref), (_, p_full) in zip(ref.named_parameters(), full.named_parameters()):
            p_ref.weight_loader(p_ref, p_full.data)
        for (name, a), (_, b) in zip(shard.named_parameters(), ref.named_parameters()):
            assert torch.equal(a, b), name


def test_fused_moe_dummy_weights_are_the_same_model_at_any_tp(monkeypatch):
    from tokenmill.layers.fused_moe import layer as moe_mod

    def build(rank, size):
        monkeypatch.setattr(moe_mod, "get_tensor_model_parallel_rank", lambda: rank)
        monkeypatch.setattr(moe_mod, "get_tensor_model_parallel_world_size", lambda: size)
        m = nn.Module()
        m.experts = moe_mod.FusedMoE(num_experts=3, top_k=2, hidden_size=8, intermediate_size=6, renormalize=True)
        initialize_dummy_weights(m, seed=5)
        return m.experts

    full = build(0, 1)
    x, logits = _rand(4, 8, seed=1), _rand(4, 3, seed=2)
    ref = full(x, logits)
    partial = sum(build(r, 2)(x, logits) for r in range(2))  # reduce_results is a no-op without a group
    torch.testing.assert_close(partial, ref)
