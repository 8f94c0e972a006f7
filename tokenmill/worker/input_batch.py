"""InputBatch: the worker's persistent per-request state, and each step's input tensors.

Requests live in rows [0, num_reqs) (kept dense: removing a row moves the
last row into the hole). Per row:

    token_ids[row]:  | prompt | output (incl. the last sampled) | unused ... |
                     |<------ num_tokens[row] ------>|
                     |<- num_computed_tokens[row] ->|<- scheduled this step ->|

`prepare_inputs` turns a step's {req_id: num_scheduled_tokens} into
input_ids, positions, slot_mapping, query_start_loc, seq_lens and
logits_indices with NumPy ops over these arrays (no per-token Python).

Async scheduling: a step may be prepared before the previous step's sampled
ids reached the host. A scheduled position equal to `num_tokens[row]` is
then such a token; its input id is copied on the device from the previous
step's sampled-ids tensor (`set_pending` records which row sampled which
entry; `append_sampled_ids` writes the ids into `token_ids` once read back).

Staging buffers: each step's inputs are written into ONE set of pinned host
buffers (`_host`, and each `BlockTable`'s `_staging`), then copied to the
device with non_blocking copies that read the host memory only when the
stream reaches them. A step must therefore not rewrite them before the
previous step's copies ran. Nothing else guarantees that: a step in which
nobody samples returns without a host wait, and under async scheduling
(engine/core.py `_step_async`) step N+1 is prepared after the engine waited
only for step N-1's results, while step N's copies may still sit in the
stream behind them. So `prepare_inputs` waits, before its first write, on
`_copies_done`, an event recorded right after the last copy of the previous
step (`_commit_block_table`); vLLM's model runner does the same
(`synchronize_input_prep`, its `prepare_inputs_event`). In the steady
async loop the wait should be short (from the order, not measured): step
N's copies are queued right behind step N-1's results, which the engine
has already waited for. The sampling
metadata and grammar bitmask are copied from fresh pageable arrays (the
driver stages those before the call returns), and the results' pinned
buffer is allocated per step, so they need no such wait.
tests/worker/test_input_batch.py checks the order (CPU, a fake event) and
that a busy stream does not let step N+1 clobber step N's inputs (GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.core.sched_output import NewRequestData
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.state import SamplingState
from tokenmill.worker.block_table import BlockTable


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs (device tensors) and what to sample."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn_metadata: AttentionMetadata
    # With a sliding-window KV group: the sliding-window layers' metadata (own block table and slots), else None.
    attn_metadata_swa: AttentionMetadata | None
    logits_indices: torch.Tensor  # [S] int64: rows of the hidden states to sample from
    rows: np.ndarray  # [num_reqs] batch rows of the scheduled requests, in token order
    sample_rows: np.ndarray  # [S] batch rows that sample, in logits order
    sampling_metadata: SamplingMetadata | None  # None when nobody samples


class InputBatch:
    """Persistent batch state.

    Args:
        max_num_reqs: rows (max_num_seqs).
        max_model_len: columns of the token array.
        max_num_batched_tokens: largest step (sizes the staging buffers).
        block_size: KV block size.
        vocab_size: logits width (for the sampler's masks).
        device: where step tensors go.
        pin_memory: pinned staging buffers (CUDA).
        copy_event: makes the event recorded after each step's host->device copies and waited on before the
            next step rewrites the staging buffers (module docstring); None: `torch.cuda.Event` on CUDA, no
            event elsewhere (CPU copies are synchronous). Tests pass a fake.
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        pin_memory: bool,
        two_groups: bool = False,
        copy_event: Callable[[], torch.cuda.Event] | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_ids: list[str] = []  # row -> req_id, rows [0, num_reqs)
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int64)
        self.block_table = BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size, device, pin_memory)
        # The sliding-window group's tables (two_groups; core/kv_cache_manager.py): same shape, entries of blocks
        # that slid out of the window stay stale and are never read.
        self.block_table_swa = (BlockTable(max_num_reqs, -(-max_model_len // block_size), block_size, device,
                                           pin_memory) if two_groups else None)
        self.sampling = SamplingState(max_num_reqs, vocab_size, device)
        # Staging buffers (pinned on CUDA) and their device twins; a step uses a prefix.
        t, r = max_num_batched_tokens, max_num_reqs
        self._host = {
            "input_ids": torch.zeros(t, dtype=torch.int64, pin_memory=pin_memory),
            "positions": torch.zeros(t, dtype=torch.int64, pin_memory=pin_memory),
            "slot_mapping": torch.zeros(t, dtype=torch.int64, pin_memory=pin_memory),
            "slot_mapping_swa": torch.zeros(t if two_groups else 0, dtype=torch.int64, pin_memory=pin_memory),
            "query_start_loc": torch.zeros(r + 1, dtype=torch.int32, pin_memory=pin_memory),
            "seq_lens": torch.zeros(r, dtype=torch.int32, pin_memory=pin_memory),
            "logits_indices": torch.zeros(r, dtype=torch.int64, pin_memory=pin_memory),
            # Async scheduling: token indices and sampled-ids entries of the not-yet-read-back inputs.
            "placeholder_dst": torch.zeros(r, dtype=torch.int64, pin_memory=pin_memory),
            "placeholder_src": torch.zeros(r, dtype=torch.int64, pin_memory=pin_memory),
        }
        self._dev = {k: torch.zeros_like(v, device=device) for k, v in self._host.items()}
        self._host_np = {k: v.numpy() for k, v in self._host.items()}
        # [0, 1, 2, ...]: query_start_loc and logits_indices of a decode step are prefixes of it.
        self._arange = np.arange(max(t, r) + 1, dtype=np.int64)
        # Bumped by every add/remove (rows may have moved); guards the cache below.
        self._layout_version = 0
        # (scheduled ids in order, layout version, their rows ascending, argsort order):
        # steps that schedule the same ids over the same rows (steady decoding) reuse it.
        self._rows_cache: tuple[list[str], int, np.ndarray, np.ndarray] | None = None
        # (name, n) -> (host[:n], device[:n]) for n <= max_num_reqs + 1 (decode-sized
        # steps): a torch slice costs ~2 us, and a step takes ~20 of them.
        self._views: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # Recorded after a step's host->device copies from the staging buffers; the next step waits on it
        # before rewriting them (module docstring, "Staging buffers").
        if copy_event is None and device.type == "cuda":
            copy_event = torch.cuda.Event
        self._copy_event = copy_event
        self._copies_done: torch.cuda.Event | None = None
        self._max_cached_view = r + 1
        # Async scheduling: per row, the step id and entry of a sampled id not yet read back (-1: none).
        self.pending_step = np.full(r, -1, np.int64)
        self.pending_idx = np.full(r, -1, np.int64)
        # (step id, sampled ids [S] on the device) of the last launched step, until it is read back.
        self._unread: tuple[int, torch.Tensor] | None = None
        self._swa_table: torch.Tensor | None = None  # this step's sliding-window block table (two groups)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def device_buffers(self) -> dict[str, torch.Tensor]:
        """The persistent device tensors each step's inputs are prefixes of (CUDA graphs read these).

        Keys: input_ids, positions, slot_mapping ([max_num_batched_tokens] int64),
        query_start_loc ([max_num_reqs + 1] int32), seq_lens ([max_num_reqs] int32),
        logits_indices, placeholder_dst, placeholder_src ([max_num_reqs] int64).
        """
        return self._dev

    # ---- membership -------------------------------------------------------------

    def add_request(self, new: NewRequestData) -> int:
        """Put a new (or resumed) request in the next free row; returns the row.

        Raises:
            ValueError: the batch is full or the request is longer than max_model_len.
        """
        if new.req_id in self.req_id_to_index:
            self.remove_request(new.req_id)
        if self.num_reqs >= self.max_num_reqs:
            raise ValueError(f"The batch already holds max_num_seqs={self.max_num_reqs} requests.")
        tokens = new.prompt_token_ids + new.output_token_ids
        if len(tokens) > self.max_model_len:
            raise ValueError(f"Request {new.req_id} has {len(tokens)} tokens; max_model_len is {self.max_model_len}.")
        self._layout_version += 1
        row = self.num_reqs
        self.req_ids.append(new.req_id)
        self.req_id_to_index[new.req_id] = row
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.block_table.add_row(row, new.block_ids)
        if self.block_table_swa is not None:
            self.block_table_swa.add_row(row, new.swa_block_ids)
        self.sampling.add(row, new.sampling_params, len(new.output_token_ids))
        self.pending_step[row] = -1
        return row

    def remove_request(self, req_id: str) -> None:
        """Drop a request (no-op if unknown); the last row moves into its place."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self._layout_version += 1
        last = self.num_reqs - 1
        if row != last:
            moved = self.req_ids[last]
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, self.pending_step,
                        self.pending_idx):
                arr[row] = arr[last]
            self.block_table.move_row(last, row)
            if self.block_table_swa is not None:
                self.block_table_swa.move_row(last, row)
            self.sampling.move(last, row)
            self.req_ids[row] = moved
            self.req_id_to_index[moved] = row
        self.req_ids.pop()
        self.block_table.clear_row(last)
        if self.block_table_swa is not None:
            self.block_table_swa.clear_row(last)
        self.sampling.clear(last)
        self.pending_step[last] = -1

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Record each row's sampled token as its next known token (the next step's input)."""
        # Tokens past max_model_len are dropped; the scheduler finishes such requests.
        ok = self.num_tokens[rows] < self.max_model_len
        rows, token_ids = rows[ok], token_ids[ok]
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def set_pending(self, step_id: int, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """Step `step_id` sampled `sampled[i]` ([S] int64, on the device) for batch row `rows[i]`; not read back yet."""
        self.pending_step[rows] = step_id
        self.pending_idx[rows] = self._arange[: len(rows)]
        self._unread = (step_id, sampled)

    def append_sampled_ids(self, step_id: int, req_ids: list[str], token_ids: list[int]) -> None:
        """Record step `step_id`'s sampled ids, read back, by request id (rows may have moved since).

        Requests no longer in the batch (finished or preempted meanwhile) are skipped.
        """
        index = self.req_id_to_index
        rows = np.fromiter((index.get(r, -1) for r in req_ids), np.int64, len(req_ids))
        ids = np.asarray(token_ids, np.int64)
        keep = rows >= 0
        if not keep.all():
            rows, ids = rows[keep], ids[keep]
        mine = self.pending_step[rows] == step_id
        self.pending_step[rows[mine]] = -1
        self.append_sampled(rows, ids)
        if self._unread is not None and self._unread[0] == step_id:
            self._unread = None

    # ---- one step's inputs -----------------------------------------------------

    def prepare_inputs(self, num_scheduled: dict[str, int]) -> StepInputs:
        """Build the step's tensors for the scheduled requests (in row order).

        Raises:
            KeyError: a scheduled request is not in the batch (a contract breach).
        """
        num_reqs = len(num_scheduled)
        counts = np.fromiter(num_scheduled.values(), np.int64, num_reqs)
        if num_reqs and not (counts > 0).all():  # ids with no tokens are not part of the step
            return self.prepare_inputs({r: n for r, n in num_scheduled.items() if n > 0})
        if self._copies_done is not None:
            # Before the first write to a staging buffer: the last step's copies have read them (module
            # docstring, "Staging buffers"; without this wait, async scheduling can clobber a queued step).
            self._copies_done.synchronize()
            self._copies_done = None
        rows, order = self._scheduled_rows(num_scheduled)
        total = int(counts.sum())
        # Decode step: one token per request, so token i belongs to request i.
        decode = total == num_reqs
        if not decode:
            counts = counts[order]
        h = self._host_np

        qsl = h["query_start_loc"][: num_reqs + 1]
        positions = h["positions"][:total]
        if decode:
            qsl[:] = self._arange[: num_reqs + 1]
            token_rows = rows
            np.take(self.num_computed_tokens, rows, out=positions)
        else:
            # Each token's request index: counts [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
            req_idx = np.repeat(np.arange(num_reqs), counts)
            # Exclusive prefix sum: [2, 5, 3] -> query_start_loc [0, 2, 7, 10]
            qsl[0] = 0
            np.cumsum(counts, out=qsl[1:])
            # Offset within its request: arange(10) - [0, 0, 2, 2, 2, 2, 2, 7, 7, 7] -> [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
            offsets = np.arange(total) - qsl[req_idx]
            token_rows = rows[req_idx]
            np.add(self.num_computed_tokens[token_rows], offsets, out=positions)
        # Flat index into token_ids: row * max_model_len + position.
        h["input_ids"][:total] = self.token_ids.ravel()[token_rows * self.max_model_len + positions]
        placeholders = self._placeholders(token_rows, positions) if self._unread is not None else None
        h["slot_mapping"][:total] = self.block_table.slot_mapping(token_rows, positions)
        if self.block_table_swa is not None:
            h["slot_mapping_swa"][:total] = self.block_table_swa.slot_mapping(token_rows, positions)
        seq_lens = h["seq_lens"][:num_reqs]
        if decode:
            np.add(positions, 1, out=seq_lens, casting="unsafe")
        else:
            seq_lens[:] = self.num_computed_tokens[rows] + counts

        # A request samples when this step reaches its last known token:
        # seq_lens [5, 9], num_tokens [5, 20] -> samples [True, False] (the 2nd is a partial prefill chunk)
        samples = seq_lens >= self.num_tokens[rows]
        if samples.all():
            sample_rows = rows
            num_sample = num_reqs
            h["logits_indices"][:num_sample] = qsl[1:] - 1
        else:
            sample_rows = rows[samples]
            num_sample = len(sample_rows)
            h["logits_indices"][:num_sample] = qsl[1:][samples] - 1

        dev = {}
        names = (("input_ids", total), ("positions", total), ("slot_mapping", total),
                 ("query_start_loc", num_reqs + 1), ("seq_lens", num_reqs), ("logits_indices", num_sample))
        if self.block_table_swa is not None:
            names += (("slot_mapping_swa", total),)
        for name, n in names:
            host_view, dev_view = self._staged(name, n)
            dev_view.copy_(host_view, non_blocking=True)
            dev[name] = dev_view
        if placeholders is not None:
            self._fill_placeholders(dev["input_ids"], *placeholders)
        md = AttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            max_query_len=(1 if decode else int(counts.max())) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            query_start_loc=dev["query_start_loc"],
            seq_lens=dev["seq_lens"],
            block_table=self._commit_block_table(rows),
            slot_mapping=dev["slot_mapping"],
            # Copies: the staging buffers are rewritten next step while backends may hold these.
            query_start_loc_cpu=qsl.copy(),
            seq_lens_cpu=seq_lens.copy(),
        )
        md_swa = None
        if self.block_table_swa is not None:
            md_swa = replace(md, block_table=self._swa_table, slot_mapping=dev["slot_mapping_swa"])
        sampling_md = None
        if num_sample:
            sampling_md = self.sampling.make_metadata(sample_rows, self.token_ids, self.num_prompt_tokens, self.num_tokens)
        return StepInputs(dev["input_ids"], dev["positions"], md, md_swa, dev["logits_indices"], rows, sample_rows,
                          sampling_md)

    def _placeholders(self, token_rows: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """(token indices, sampled-ids entries) of this step's tokens not yet read back; None if there are none.

        Raises:
            RuntimeError: a scheduled token is neither known nor the last launched step's sample.
        """
        ph = positions >= self.num_tokens[token_rows]
        if not ph.any():
            return None
        dst = np.flatnonzero(ph)
        prow = token_rows[dst]
        assert self._unread is not None
        if not (self.pending_step[prow] == self._unread[0]).all() or not (positions[dst] == self.num_tokens[prow]).all():
            raise RuntimeError("A step was scheduled past the tokens known and being sampled (async scheduling).")
        return dst, self.pending_idx[prow]

    def _fill_placeholders(self, input_ids: torch.Tensor, dst: np.ndarray, src: np.ndarray) -> None:
        """input_ids[dst] = (last launched step's sampled ids)[src], on the device (no host sync)."""
        assert self._unread is not None
        staged = []
        for name, values in (("placeholder_dst", dst), ("placeholder_src", src)):
            host_view, dev_view = self._staged(name, len(values))
            host_view.numpy()[:] = values
            dev_view.copy_(host_view, non_blocking=True)
            staged.append(dev_view)
        sampled = self._unread[1]
        input_ids.index_copy_(0, staged[0], sampled.index_select(0, staged[1]).to(input_ids.dtype))

    def _commit_block_table(self, rows: np.ndarray) -> torch.Tensor:
        """The block table rows on the device (and the sliding-window group's, kept in `_swa_table`); then
        mark the step's staged copies (on CUDA). The step's last copy from a staging buffer: every other one
        is issued before this call."""
        table = self.block_table.commit(rows)
        if self.block_table_swa is not None:
            self._swa_table = self.block_table_swa.commit(rows)
        if self._copy_event is not None:
            self._copies_done = self._copy_event()
            self._copies_done.record()
        return table

    def _staged(self, name: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(host staging[:n], device buffer[:n]) of buffer `name`; cached for decode-sized n."""
        key = (name, n)
        views = self._views.get(key)
        if views is None:
            views = (self._host[name][:n], self._dev[name][:n])
            if n <= self._max_cached_view:
                self._views[key] = views
        return views

    def _scheduled_rows(self, num_scheduled: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """Rows of the scheduled ids, ascending, and the argsort that orders them so.

        ids ["b", "a"] at rows {"a": 0, "b": 3} -> rows [0, 3], order [1, 0].
        Cached while the same ids come in the same order and no request was
        added or removed (the usual decode step); the cached arrays are
        returned as they are and must not be written to.
        """
        ids = list(num_scheduled)
        cache = self._rows_cache
        if cache is not None and cache[1] == self._layout_version and cache[0] == ids:
            return cache[2], cache[3]
        rows = np.fromiter((self.req_id_to_index[r] for r in ids), np.int64, len(ids))
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        self._rows_cache = (ids, self._layout_version, rows, order)
        return rows, order
