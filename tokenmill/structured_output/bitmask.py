"""Applying a packed grammar bitmask to the logits (worker side, torch only).

The engine core sends one int32 row per structured request: bit j of word w
is set when token 32 * w + j is allowed. Rows of other requests are left
untouched. Pure torch, so it runs on any device without xgrammar installed
in the worker and without a host sync.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed int32 words -> bool allowed-mask.

    Args:
        bitmask: [N, W] int32, W >= ceil(vocab_size / 32).
        vocab_size: V, columns kept.

    Returns:
        [N, V] bool, True where the token is allowed.

    Example: word 0b101 (= 5) -> [True, False, True, False, ...]; a negative
    word (sign bit set) works the same since `>>` then `& 1` reads one bit.
    """
    dev = bitmask.device
    shifts = _SHIFTS_CACHE.get(dev)
    if shifts is None:
        shifts = _SHIFTS_CACHE[dev] = torch.arange(32, dtype=torch.int32, device=dev)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: torch.Tensor) -> None:
    """Set disallowed tokens' logits to -inf, in place.

    Args:
        logits: [S, V] float logits of the rows that sample this step.
        bitmask: [N, W] int32 packed allowed bits for N of those rows.
        logits_rows: [N] int64, the logits row each bitmask row applies to.
    """
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    rows = logits[logits_rows]
    logits[logits_rows] = rows.masked_fill(~allowed, float("-inf"))


def grammar_rows(scheduler_output: Any, sample_req_ids: list[str],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The step's (bitmask [N, W] int32, logits_rows [N] int64) on `device`, or None.

    Args:
        scheduler_output: a `SchedulerOutput` (its `structured_output_request_ids`
            maps req_id -> bitmask row; `grammar_bitmask` is a NumPy array).
        sample_req_ids: req ids in logits-row order (the rows that sample).
    """
    so_ids = getattr(scheduler_output, "structured_output_request_ids", None)
    if not so_ids or scheduler_output.grammar_bitmask is None:
        return None
    pairs = [(i, so_ids[r]) for i, r in enumerate(sample_req_ids) if r in so_ids]
    if not pairs:
        return None
    logits_rows = np.array([p[0] for p in pairs], np.int64)
    mask_rows = np.array([p[1] for p in pairs], np.int64)
    bitmask = np.ascontiguousarray(scheduler_output.grammar_bitmask[mask_rows])
    return (torch.from_numpy(bitmask).to(device, non_blocking=True),
            torch.from_numpy(logits_rows).to(device, non_blocking=True))
