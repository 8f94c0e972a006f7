"""Applying a packed grammar bitmask to the logits (worker side, torch only).

The engine core sends one int32 row per structured request: bit j of word w
is set when token 32 * w + j is allowed. Rows of other requests are left
untouched. xgrammar's kernel does the work when installed; a pure-torch
unpack is the fallback. Neither syncs with the device.
"""

from __future__ import annotations

import functools
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

    Works on the bytes (little-endian: byte k of word w holds tokens
    32w + 8k .. 32w + 8k + 7), 4x less traffic than shifting int32 words:
    word 5 = 0b101 -> bytes [5, 0, 0, 0] -> [True, False, True, False, ...].
    """
    dev = bitmask.device
    shifts = _SHIFTS_CACHE.get(dev)
    if shifts is None:
        shifts = _SHIFTS_CACHE[dev] = torch.arange(8, dtype=torch.uint8, device=dev)
    as_bytes = bitmask.contiguous().view(torch.uint8)  # [N, 4W]
    bits = (as_bytes.unsqueeze(-1) >> shifts) & 1  # [N, 4W, 8]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, logits_rows: torch.Tensor,
                          rows_list: list[int] | None = None) -> None:
    """Set disallowed tokens' logits to -inf, in place.

    Args:
        logits: [S, V] float logits of the rows that sample this step.
        bitmask: [S, W] int32 packed allowed bits, row i for logits row i
            (rows not in `logits_rows` are ignored).
        logits_rows: [N] int64, the rows under a grammar.
        rows_list: the same rows as a host list (lets xgrammar's kernel run).

    Uses xgrammar's kernel (C++ on CPU, Triton/CUDA on GPU) when it is
    installed, else a pure-torch unpack.
    """
    xgr_apply = _xgrammar_apply()
    if xgr_apply is not None and rows_list is not None and logits.dtype == torch.float32:
        xgr_apply(logits, bitmask, vocab_size=logits.shape[1], indices=rows_list)
        return
    allowed = unpack_bitmask(bitmask[logits_rows], logits.shape[1])
    logits[logits_rows] = logits[logits_rows].masked_fill(~allowed, float("-inf"))


def grammar_rows(scheduler_output: Any, sample_req_ids: list[str],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
    """The step's (bitmask [S, W] int32, logits_rows [N] int64, logits_rows as a list), or None.

    Row i of the bitmask belongs to logits row i; rows without a grammar are
    all ones (every token allowed) and are not in `logits_rows`.

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
    rows = [p[0] for p in pairs]
    src = scheduler_output.grammar_bitmask
    # [S, W]: -1 (all bits set) everywhere, the request's row where it has a grammar.
    aligned = np.full((len(sample_req_ids), src.shape[1]), -1, np.int32)
    aligned[rows] = src[[p[1] for p in pairs]]
    return (torch.from_numpy(aligned).to(device, non_blocking=True),
            torch.tensor(rows, dtype=torch.int64, device=device), rows)


@functools.cache
def _xgrammar_apply() -> Any:
    """xgrammar's in-place kernel, imported on first use (a worker without grammars never imports it)."""
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        return None
    return apply_token_bitmask_inplace
