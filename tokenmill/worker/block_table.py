"""BlockTable: the worker's per-row KV block ids, and slot mapping from positions."""

from __future__ import annotations

import numpy as np
import torch


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
        self._staging = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, pin_memory=pin_memory)
        self._staging_np = self._staging.numpy()
        self.block_table = torch.zeros((max_num_reqs, max_num_blocks_per_req), dtype=torch.int32, device=device)
        # n -> (staging[:n], block_table[:n]): torch slicing costs microseconds, n repeats every step.
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

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

        Entries past a row's blocks hold stale ids; backends never read them
        (attention stops at seq_lens).
        """
        n = len(rows)
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self._staging[:n], self.block_table[:n])
        np.take(self.block_table_np, rows, axis=0, out=self._staging_np[:n])
        views[1].copy_(views[0], non_blocking=True)
        return views[1]
