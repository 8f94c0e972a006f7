"""Logits transforms used by the sampler: penalties, top-k / top-p / min-p filters.

Each takes logits [S, V] float32 and per-row parameters [S], and writes -inf
where a token is removed. Row-wise "off" values (top_k = V, top_p = 1,
min_p = 0, neutral penalties) leave a row unchanged.
"""

from __future__ import annotations

import numpy as np
import torch


def apply_penalties(
    logits: torch.Tensor,  # [S, V] float32, modified in place
    output_counts: torch.Tensor,  # [S, V] float32 occurrences in the output so far
    prompt_mask: torch.Tensor,  # [S, V] bool token in the prompt
    presence: torch.Tensor,  # [S]
    frequency: torch.Tensor,  # [S]
    repetition: torch.Tensor,  # [S]
) -> torch.Tensor:
    """vLLM's penalties.

    Repetition (CTRL, Keskar et al. 2019): for tokens seen in prompt or
    output, logit / r if logit > 0 else logit * r. Presence / frequency
    (OpenAI API docs): logit -= presence * [count > 0] + frequency * count,
    over output tokens only.
    """
    seen = prompt_mask | (output_counts > 0)
    r = repetition[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, scaled, logits)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(
    logits: torch.Tensor,  # [S, V] float32
    top_k: torch.Tensor | None,  # [S] int64 in [1, V]
    top_p: torch.Tensor | None,  # [S] float32 in (0, 1]
    max_top_k: int | None = None,  # host int = top_k.max(); given, the top-k-only path makes no host sync
) -> torch.Tensor:
    """Keep the top-k tokens, then the smallest set whose probability reaches top_p.

    Ties at the k-th value are kept (a threshold, as vLLM). Nucleus sampling:
    Holtzman et al. 2019 (arXiv:1904.09751); the most likely token is always kept.
    """
    if top_p is None:
        assert top_k is not None
        # Only top-k: topk at the batch's largest k, then each row's k-th value is its threshold.
        # k = [2, 1], sorted rows [[5, 4, 3], [9, 2, 1]] -> thresholds [4, 9]
        max_k = int(top_k.max()) if max_top_k is None else max_top_k
        values = logits.topk(max_k, dim=-1).values
        kth = values.gather(1, (top_k - 1).clamp(max=max_k - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the mass strictly before it already reaches top_p:
    # probs [0.5, 0.3, 0.2], p 0.7 -> mass before [0, 0.5, 0.8] -> keep [T, T, F]
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 drop nothing (the cumsum may round past 1.0).
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens whose probability is below min_p * the row's top probability.

    probs [S, V] (rows sum to 1), min_p [S]. Source: Nguyen et al. 2024,
    "Min P Sampling" (arXiv:2407.01082); vLLM applies it after temperature.
    """
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return probs.masked_fill(probs < threshold, 0.0)


# Columns per chunk of `argmax_rows`' first pass.
_ARGMAX_CHUNK = 128
# Up to this many float32 rows, `argmax_rows` on the CPU is one NumPy argmax (see there).
_NUMPY_ARGMAX_MAX_ROWS = 8


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` of a [S, V] tensor, the same index (first of ties, NaN counts as the maximum).

    On CPU, torch's argmax is not vectorized while a max reduction is: batch
    64 x SmolLM2's 49152 logits, one thread, float32 argmax 8.0 ms, this 0.9
    ms (bfloat16: 15.4 -> 2.7 ms). So: each row's chunks of `_ARGMAX_CHUNK` columns
    are reduced by `amax`, the argmax of those [S, V / chunk] maxima names the
    first chunk holding the row's maximum, and an argmax inside that chunk
    gives the index. The first chunk that holds the maximum holds its first
    occurrence, so ties resolve as torch's argmax does. Other devices, rows
    shorter than two chunks and rows whose columns are not contiguous call
    `argmax` directly. Returns [S] int64.

    Up to `_NUMPY_ARGMAX_MAX_ROWS` contiguous float32 rows on the CPU (decode
    at low concurrency) take NumPy's argmax instead, which is vectorized and
    resolves ties and NaN the same way: one call where the chunked path makes
    seven torch ops. Right after a decode step the interpreter's and torch's
    code is out of the caches (the step streams ~96 MB of weights), so each
    op then costs 30-60 us: SmolLM2 Q4_1 at one row, the whole sampler took
    238.9-257.6 us of thread CPU a step this way against 111.9-112.8 with
    NumPy (`benchmarks/engine_step_overhead.py --steps 200`, alternated,
    session 14). Past a few rows the chunked path's threads are faster.
    """
    num_rows, num_cols = x.shape
    num_chunks = num_cols // _ARGMAX_CHUNK
    if x.device.type != "cpu" or num_chunks < 2 or x.stride(-1) != 1:
        return x.argmax(dim=-1)
    if x.dtype == torch.float32 and num_rows <= _NUMPY_ARGMAX_MAX_ROWS and x.is_contiguous():
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1).astype(np.int64, copy=False))
    body = num_chunks * _ARGMAX_CHUNK
    chunk_max = x[:, :body].view(num_rows, num_chunks, _ARGMAX_CHUNK).amax(dim=-1)
    if body < num_cols:  # the tail is one more (shorter) chunk
        chunk_max = torch.cat([chunk_max, x[:, body:].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * _ARGMAX_CHUNK  # [S]
    # The tail chunk's missing columns repeat the last one: after the real ones, so never first.
    cols = (start[:, None] + torch.arange(_ARGMAX_CHUNK, device=x.device)).clamp_(max=num_cols - 1)
    return start + x.gather(1, cols).argmax(dim=-1)
