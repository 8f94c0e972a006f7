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


# ---- staging buffers and the previous step's copies (input_batch.py, "Staging buffers") ----------------------


def _new_swa(req_id, prompt, blocks, swa_blocks):
    return NewRequestData(req_id, list(prompt), [], SamplingParams(temperature=0.0), list(blocks), 0,
                          list(swa_blocks))


class _StagingEvent:
    """A stand-in for torch.cuda.Event over a model of the stream: the copies queued before `record()` read the
    staging buffers when the stream gets there, i.e. at the latest when `synchronize()` returns. `record()`
    keeps the bytes they must read; `synchronize()` notes whether the buffers still held them."""

    def __init__(self, staging: list[torch.Tensor], log: list[tuple[str, _StagingEvent]]) -> None:
        self.staging, self.log = staging, log
        self.snapshot: list[torch.Tensor] = []
        self.unchanged_at_sync: bool | None = None

    def record(self) -> None:
        self.snapshot = [t.clone() for t in self.staging]
        self.log.append(("record", self))

    def synchronize(self) -> None:
        self.unchanged_at_sync = all(torch.equal(a, b) for a, b in zip(self.snapshot, self.staging))
        self.log.append(("sync", self))


def test_next_step_waits_for_the_last_steps_copies_before_rewriting_staging():
    """Async scheduling prepares step 2 while step 1's sampled id is not read back (and, on CUDA, its
    host->device copies may still be queued). Step 2 must wait on the event recorded after ALL of step 1's
    copies before it writes any staging buffer, and record its own event after its last copy (the block
    tables). Fails if the wait in prepare_inputs is dropped or moved after a write, or the record moved
    before the block-table commits."""
    staging: list[torch.Tensor] = []
    log: list[tuple[str, _StagingEvent]] = []
    b = InputBatch(4, 64, 64, 4, vocab_size=100, device=torch.device("cpu"), pin_memory=False, two_groups=True,
                   copy_event=lambda: _StagingEvent(staging, log))
    staging += [*b._host.values(), b.block_table._staging, b.block_table_swa._staging]
    b.add_request(_new_swa("a", range(10, 16), [3, 8], [5, 9]))
    s1 = b.prepare_inputs({"a": 6})
    b.set_pending(1, s1.sample_rows, torch.tensor([77]))  # step 1 sampled 77 for "a"; not read back yet
    b.add_request(_new_swa("b", [20, 21, 22], [11], [12]))
    b.num_computed_tokens[b.req_id_to_index["a"]] = 6
    s2 = b.prepare_inputs({"a": 1, "b": 3})
    assert s2.input_ids.tolist() == [77, 20, 21, 22]  # a's input is step 1's sample, taken on the device

    ev1, ev2 = [ev for what, ev in log if what == "record"]
    assert [(what, ev is ev1) for what, ev in log] == [("record", True), ("sync", True), ("record", False)]
    assert ev1.unchanged_at_sync  # step 2 wrote nothing before its wait
    assert ev2.unchanged_at_sync is None  # no step 3 yet
    # Each event's snapshot holds its own step's block ids: recorded after the block-table commits.
    cols = b.block_table.max_num_blocks_per_req  # 16 columns, under COLUMN_QUANTUM: full width
    bt1, swa1 = ev1.snapshot[-2][:cols], ev1.snapshot[-1][:cols]
    bt2, swa2 = ev2.snapshot[-2][: 2 * cols].view(2, cols), ev2.snapshot[-1][: 2 * cols].view(2, cols)
    assert bt1[:2].tolist() == [3, 8] and swa1[:2].tolist() == [5, 9]
    assert bt2[:, 0].tolist() == [3, 11] and swa2[:, 0].tolist() == [5, 12]
    assert torch.equal(s2.attn_metadata.block_table[:2, 0], torch.tensor([3, 11], dtype=torch.int32))


class _NoWaitEvent:
    """An event that never waits: InputBatch without the wait, for the control case below."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _two_step_batch(device: str, max_len: int, copy_event=None) -> InputBatch:
    b = InputBatch(4, max_len, 64, 4, vocab_size=100, device=torch.device(device), pin_memory=device == "cuda",
                   two_groups=True, copy_event=copy_event)
    b.add_request(_new_swa("a", range(10, 16), [2, 0], [7, 1]))
    b.add_request(_new_swa("b", range(20, 30), [1, 3, 5], [6, 4, 9]))
    return b


def _step1_view(s) -> dict[str, torch.Tensor]:
    """What step 1's forward reads (the device tensors of its inputs), cloned where it stands in the stream."""
    md, swa = s.attn_metadata, s.attn_metadata_swa
    return {"input_ids": s.input_ids.clone(), "positions": s.positions.clone(),
            "slot_mapping": md.slot_mapping.clone(), "slot_mapping_swa": swa.slot_mapping.clone(),
            "seq_lens": md.seq_lens.clone(), "query_start_loc": md.query_start_loc.clone(),
            "logits_indices": s.logits_indices.clone(),
            "block_table": md.block_table[:2, :3].clone(), "block_table_swa": swa.block_table[:2, :3].clone()}


@pytest.mark.gpu
@pytest.mark.parametrize("max_len", [64, 1024])  # block-table copy at full width / through the device staging
@pytest.mark.parametrize("wait", [True, False])
def test_busy_stream_next_step_does_not_clobber_queued_copies(max_len, wait):
    """Step 1's copies are queued behind a ~0.1 s kernel when step 2 is prepared at once (as async scheduling
    does, with other requests and blocks): step 1's inputs on the device must still be step 1's. wait=False
    is the control: InputBatch with an event that never waits, where step 2's host writes reach step 1's
    queued copies (it shows that this test sees the race)."""
    ref = _step1_view(_two_step_batch("cpu", max_len).prepare_inputs({"a": 6, "b": 10}))
    b = _two_step_batch("cuda", max_len, None if wait else _NoWaitEvent)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s at 2 GHz: the stream is busy, step 1's copies wait behind it
    step1 = _step1_view(b.prepare_inputs({"a": 6, "b": 10}))  # the clones are queued after step 1's copies
    b.remove_request("a")
    b.remove_request("b")
    b.add_request(_new_swa("c", [40, 41, 42], [9], [8]))
    b.prepare_inputs({"c": 3})  # step 2: same staging buffers, other tokens and block ids
    torch.cuda.synchronize()
    clobbered = [k for k in ref if not torch.equal(step1[k].cpu(), ref[k])]
    if wait:
        assert clobbered == []
    else:
        assert {"input_ids", "block_table", "block_table_swa"} <= set(clobbered)
