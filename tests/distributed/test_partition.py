"""Head / layer partition rules and the start-up errors for sizes that do not split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tokenmill.distributed.partition import (
    head_partition,
    heads_fit,
    pp_layer_range,
    tp_size_fits,
    verify_parallel_sizes,
)


def _cover(nh: int, nkv: int, tp: int):
    parts = [head_partition(nh, nkv, tp, r) for r in range(tp)]
    return parts


def test_smollm2_uneven_split_by_kv_groups():
    # 9 query heads in 3 groups of 3 over 2 ranks: 2 groups + 1 group.
    p0, p1 = _cover(9, 3, 2)
    assert (p0.num_heads, p0.q_start, p0.num_kv_heads, p0.kv_start) == (6, 0, 2, 0)
    assert (p1.num_heads, p1.q_start, p1.num_kv_heads, p1.kv_start) == (3, 6, 1, 2)


@pytest.mark.parametrize("nh,nkv,tp", [(9, 3, 2), (9, 3, 3), (32, 8, 3), (32, 8, 8), (12, 4, 4), (7, 7, 3)])
def test_partitions_cover_every_head_once_and_keep_groups_whole(nh, nkv, tp):
    group = nh // nkv
    q_seen = []
    for p in _cover(nh, nkv, tp):
        q_heads = range(p.q_start, p.q_start + p.num_heads)
        q_seen.extend(q_heads)
        # Each query head's KV head (h // group) is on the same rank.
        assert {h // group for h in q_heads} == set(range(p.kv_start, p.kv_start + p.num_kv_heads))
    assert q_seen == list(range(nh))


def test_kv_heads_replicated_when_fewer_than_ranks():
    parts = _cover(8, 2, 4)
    assert [p.num_kv_heads for p in parts] == [1, 1, 1, 1]
    assert [p.kv_start for p in parts] == [0, 0, 1, 1]
    assert [p.q_start for p in parts] == [0, 2, 4, 6]
    # Query heads 0-3 use KV head 0, 4-7 KV head 1.
    for p in parts:
        assert p.q_start // 4 == p.kv_start


def test_impossible_head_split_names_working_sizes():
    assert not heads_fit(9, 3, 4)  # 4 % 3 != 0
    assert not heads_fit(9, 3, 10)  # more ranks than query heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* Sizes that work: 1, 2, 3, 9\."):
        head_partition(9, 3, 4, 0)


def _smollm2_like(**kw):
    base = dict(num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, num_hidden_layers=30)
    base.update(kw)
    return SimpleNamespace(**base)


def test_verify_parallel_sizes_checks_mlp_and_lists_sizes():
    cfg = _smollm2_like()
    assert tp_size_fits(cfg, 2) and tp_size_fits(cfg, 3)
    assert not tp_size_fits(cfg, 9)  # heads fit, but 1536 % 9 != 0
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 does not fit .*9 attention heads, 3 KV heads, "
                                         r"intermediate_size=1536.* Sizes that work: 1, 2, 3\."):
        verify_parallel_sizes(cfg, 4, 1)
    verify_parallel_sizes(cfg, 2, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size=96"):
        verify_parallel_sizes(_smollm2_like(moe_intermediate_size=96), 9, 1)


def test_pp_layer_ranges():
    assert [pp_layer_range(30, r, 2) for r in range(2)] == [(0, 15), (15, 30)]
    assert [pp_layer_range(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is larger than the number of layers \\(4\\)"):
        pp_layer_range(4, 0, 5)
