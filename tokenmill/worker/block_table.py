"""BlockTable: the worker's per-row KV block ids, and slot mapping from positions."""

from __future__ import annotations

import numpy as np
import torch

# `commit` copies a multiple of this many columns (block ids) per row, so (rows, columns) repeats across the
# steps of a growing context (16 x 64 = 1,024 tokens) and its views stay cached.
COLUMN_QUANTUM = 64
_MAX_CACHED_VIEWS = 512


class BlockTable:
    """Block ids by batch row, in a NumPy array mirrored to the device each step.

    Args:
        max_num_reqs: rows.
        max_num_blocks_per_req: columns (ceil(max_model_len / block_size)).
        block_size: tokens per block.
        device: device of the per-step block table tensor.
        pin_memory: use a pinned host staging buffer (CUDA).
    """

    def __init__(
        self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int, device: torch.device, pin_memory: bool
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.block_table_np = np.zeros((max_num_reqs, max_num_blocks_per_req), np.int32)
        self.num_blocks_per_row = np.zeros(max_num_reqs, np.int32)
        # Flat staging buffers: a step's [n, cols] rows are packed contiguously at their start (see `commit`).
        size = max_num_reqs * max_num_blocks_per_req
        self._staging = torch.zeros(size, dtype=torch.int32, pin_memory=pin_memory)
        self._dev_staging = (self._staging if device.type == "cpu"
                             else torch.zeros(size, dtype=torch.int32, device=device))
        self.block_table = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device)
        # (n, cols) -> (host staging [n, cols] as NumPy and torch, device staging [n, cols] or None,
        # block_table[:n, :cols], block_table[:n]):
        # torch slicing costs microseconds, and (n, cols) repeats step after step.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def add_row(self, row: int, block_ids: list[int]) -> None:
        """Replace row `row` with `block_ids`."""
        self.num_blocks_per_row[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        """Append `block_ids` to row `row`.

        Raises:
            ValueError: the row would exceed max_num_blocks_per_req.
        """
        if not block_ids:
            return
        start = int(self.num_blocks_per_row[row])
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(
                f"A request needs {end} KV blocks but at most {self.max_num_blocks_per_req} fit max_model_len."
            )
        self.block_table_np[row, start:end] = block_ids
        self.num_blocks_per_row[row] = end

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks_per_row[src])
        self.block_table_np[dst, :n] = self.block_table_np[src, :n]
        self.num_blocks_per_row[dst] = n

    def clear_row(self, row: int) -> None:
        self.num_blocks_per_row[row] = 0

    def slot_mapping(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Cache slot of each token: [T] int64.

        rows [T]: each token's batch row; positions [T]: its position.
        slot = block_table[row, pos // block_size] * block_size + pos % block_size
        block 16, row 0 table [7, 3], positions [15, 16, 17] -> [7*16+15, 3*16+0, 3*16+1] = [127, 48, 49]
        """
        block_ids = self.block_table_np[rows, positions // self.block_size].astype(np.int64)
        return block_ids * self.block_size + positions % self.block_size

    def commit(self, rows: np.ndarray) -> torch.Tensor:
        """Copy the table rows `rows` (in that order) to the device: [len(rows), max_blocks] int32.

        Only the columns some of these rows use are copied, rounded up to a
        multiple of `COLUMN_QUANTUM`: a step's host work and transfer follow the
        blocks its requests hold, not max_model_len (256 rows x 8,192 columns
        for max_model_len 131072 are 8 MiB a step). Entries past the copied
        columns, like those past a row's own blocks, hold stale ids; backends
        never read them (attention stops at seq_lens, and every row's blocks
        lie within the copied columns).

            rows [2, 0], blocks per row {0: 3, 2: 1}, quantum 2 -> cols 4:
            block_table[0, :4] = table[2, :4]; block_table[1, :4] = table[0, :4]

        On CUDA the rows go through one pinned staging buffer, reused by
        every call, and a non_blocking copy that reads it only when the
        stream gets there: the caller must not call `commit` again before
        this call's copies ran, or they would carry the next call's block
        ids (the wrong KV blocks, silently). `InputBatch.prepare_inputs`,
        the only caller, waits on an event recorded after the copies before
        it writes any staging buffer (worker/input_batch.py, "Staging
        buffers").
        """
        n = len(rows)
        used = int(self.num_blocks_per_row[rows].max()) if n else 0
        cols = min(-(-max(used, 1) // COLUMN_QUANTUM) * COLUMN_QUANTUM, self.max_num_blocks_per_req)
        views = self._views.get((n, cols))
        if views is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:
                self._views.clear()
            host = self._staging[: n * cols].view(n, cols)
            # Full width: block_table[:n] is contiguous and takes the rows directly. Fewer columns: the rows
            # go packed to a device staging buffer in one plain transfer, then one strided device copy puts
            # them into the persistent table (whose rows the CUDA graphs read).
            dev = None if cols == self.max_num_blocks_per_req or self._dev_staging is self._staging else (
                self._dev_staging[: n * cols].view(n, cols))
            views = (host.numpy(), host, dev, self.block_table[:n, :cols], self.block_table[:n])
            self._views[(n, cols)] = views
        host_np, host, dev, dst, table = views
        if cols == self.max_num_blocks_per_req:
            np.take(self.block_table_np, rows, axis=0, out=host_np)
        else:
            # Not np.take over table[:, :cols]: it first copies that whole non-contiguous slice (every row).
            host_np[...] = self.block_table_np[rows, :cols]
        if dev is not None:
            dev.copy_(host, non_blocking=True)
            host = dev
        dst.copy_(host, non_blocking=True)
        return table
