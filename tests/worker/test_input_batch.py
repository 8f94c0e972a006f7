"""InputBatch / BlockTable: per-step tensors on small worked examples."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.core.sched_output import NewRequestData
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.block_table import BlockTable
from tokenmill.worker.input_batch import InputBatch


def _batch(max_reqs=4, max_len=64, block_size=4):
    return InputBatch(max_reqs, max_len, 64, block_size, vocab_size=100, device=torch.device("cpu"), pin_memory=False)


def _new(req_id, prompt, blocks, computed=0, output=()):
    return NewRequestData(req_id, list(prompt), list(output), SamplingParams(temperature=0.0), list(blocks), computed)


def test_slot_mapping_worked_example():
    bt = BlockTable(2, 4, 16, torch.device("cpu"), False)
    bt.add_row(0, [7, 3])
    bt.add_row(1, [5])
    slots = bt.slot_mapping(np.array([0, 0, 0, 1]), np.array([15, 16, 17, 2]))
    assert slots.tolist() == [7 * 16 + 15, 3 * 16, 3 * 16 + 1, 5 * 16 + 2]
    bt.append_row(1, [9, 2])
    assert bt.block_table_np[1, :3].tolist() == [5, 9, 2]
    with pytest.raises(ValueError, match="KV blocks"):
        bt.append_row(1, [1, 1])


def test_prepare_inputs_mixed_step():
    b = _batch()
    b.add_request(_new("a", range(10, 16), [2, 0]))  # 6-token prompt, fresh: whole prompt
    b.add_request(_new("b", range(20, 30), [1, 3, 5], computed=4))  # 10 tokens, chunk 4..7 (partial)
    b.add_request(_new("c", [40, 41, 42], [4], computed=2, output=[]))  # last prompt token only
    s = b.prepare_inputs({"a": 6, "b": 4, "c": 1})
    assert s.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 2]
    assert s.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 42]
    # a: blocks [2, 0]; b: [1, 3, 5]; c: [4]; block_size 4
    assert s.attn_metadata.slot_mapping.tolist() == [8, 9, 10, 11, 0, 1, 12, 13, 14, 15, 18]
    assert s.attn_metadata.query_start_loc.tolist() == [0, 6, 10, 11]
    assert s.attn_metadata.seq_lens.tolist() == [6, 8, 3]
    assert s.attn_metadata.seq_lens_cpu.tolist() == [6, 8, 3]
    # b's chunk stops short of its last token: it does not sample.
    assert s.sample_rows.tolist() == [0, 2]
    assert s.logits_indices.tolist() == [5, 10]
    assert s.attn_metadata.block_table[1, :3].tolist() == [1, 3, 5]
    assert s.attn_metadata.max_query_len == 6 and s.attn_metadata.max_seq_len == 8


def test_decode_after_sample_reads_the_sampled_token():
    b = _batch()
    b.add_request(_new("a", [1, 2, 3], [0]))
    s = b.prepare_inputs({"a": 3})
    b.append_sampled(s.sample_rows, np.array([77]))
    b.num_computed_tokens[0] = 3
    s = b.prepare_inputs({"a": 1})
    assert s.input_ids.tolist() == [77] and s.positions.tolist() == [3]
    assert s.sample_rows.tolist() == [0]


def test_remove_compacts_rows_and_unscheduled_rows_are_skipped():
    b = _batch()
    for i, r in enumerate("abc"):
        b.add_request(_new(r, [i] * 5, [i, i + 5]))
    b.remove_request("a")
    assert b.req_ids == ["c", "b"] and b.req_id_to_index == {"c": 0, "b": 1}
    assert b.token_ids[0, :5].tolist() == [2] * 5 and b.block_table.block_table_np[0, 0] == 2
    s = b.prepare_inputs({"b": 5})  # c not scheduled this step
    assert s.input_ids.tolist() == [1] * 5 and s.attn_metadata.num_reqs == 1
    assert s.attn_metadata.slot_mapping.tolist() == [4, 5, 6, 7, 24]  # blocks [1, 6], positions 0..4
    b.remove_request("zzz")  # unknown: no-op
    assert b.num_reqs == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_commit_copies_only_the_columns_the_rows_use(device, monkeypatch):
    """A step copies its rows' used columns (rounded up to COLUMN_QUANTUM), not max_model_len's: the columns
    past them keep whatever the device table held (here a sentinel), and the copied ones are exact."""
    from tokenmill.worker import block_table as bt_module

    monkeypatch.setattr(bt_module, "COLUMN_QUANTUM", 4)
    dev = torch.device(device)
    bt = BlockTable(3, 16, 16, dev, pin_memory=device == "cuda")
    bt.add_row(0, [7, 3, 9])
    bt.add_row(1, [5])
    bt.add_row(2, list(range(20, 30)))
    bt.block_table.fill_(-7)
    table = bt.commit(np.array([1, 0]))  # 3 blocks at most -> 4 columns
    assert table.shape == (2, 16)
    assert table[:, :4].tolist() == [[5, 0, 0, 0], [7, 3, 9, 0]]
    assert (table[:, 4:] == -7).all() and (bt.block_table[2] == -7).all()
    bt.block_table.fill_(-7)
    table = bt.commit(np.array([2, 1, 0]))  # 10 blocks -> 12 columns
    assert table[0, :12].tolist() == list(range(20, 30)) + [0, 0]
    assert table[2, :3].tolist() == [7, 3, 9] and (table[:, 12:] == -7).all()
    bt.append_row(1, list(range(40, 46)))  # 7 blocks -> 8 columns; row 0 held row 2's ids past them
    table = bt.commit(np.array([1]))
    assert table[0].tolist() == [5, *range(40, 46), 0, 28, 29, 0, 0] + [-7] * 4
    bt.append_row(1, list(range(46, 55)))  # 16 blocks: the full width
    assert bt.commit(np.array([1]))[0].tolist() == [5, *range(40, 55)]
