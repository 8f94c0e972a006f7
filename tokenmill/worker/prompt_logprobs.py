"""Prompt logprobs: each prompt token's log-probability given the tokens before it, out of the model runner.

A step computes tokens [start, end) of a request (one prefill chunk). The
hidden state at position p predicts token p + 1, so the chunk yields the
logprobs of prompt tokens start + 1 .. min(end, P - 1) (P = prompt length;
the hidden state at P - 1 predicts the first output token, which is sampled,
not scored here):

    prompt  t0 t1 t2 t3 t4 t5      P = 6, chunks [0, 4) and [4, 6)
    chunk 1 h0 h1 h2 h3       -> logprobs of t1 t2 t3 t4
    chunk 2             h4 h5 -> logprobs of t5 (h5 predicts the first output)

Chunks are gathered per request until its prompt is done, then returned
whole, so a prompt split over several steps gives the same rows as one
step. Requests asking for prompt logprobs never take prompt blocks from the
prefix cache (`KVCacheManager.get_computed_blocks`), so every position is
computed here; one resumed after a preemption with tokens already generated
has returned its prompt logprobs before and is not tracked again.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.core.sched_output import LogprobsLists

# Positions whose [n, vocab] float32 logits are materialized at once (bounds
# the extra memory of a long prefill chunk: 512 x 152k x 4 B = 311 MB).
_POSITIONS_PER_PASS = 512


class PromptLogprobsCollector:
    """The prompt logprobs of the requests in the batch that asked for them.

    Args:
        vocab_size: logits width (top-k is capped by it).
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # req_id -> k (top logprobs per position)
        self._num_top: dict[str, int] = {}
        # req_id -> per chunk: (ids [n, k + 1], logprobs [n, k + 1], ranks [n]) as host arrays
        self._parts: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}

    def add_request(self, req_id: str, prompt_logprobs: int | None, num_output_tokens: int) -> None:
        """Track `req_id` when it asks for prompt logprobs and has not generated yet (a fresh start)."""
        self.remove_request(req_id)
        if prompt_logprobs is not None and num_output_tokens == 0:
            self._num_top[req_id] = min(prompt_logprobs, self.vocab_size)
            self._parts[req_id] = []

    def remove_request(self, req_id: str) -> None:
        self._num_top.pop(req_id, None)
        self._parts.pop(req_id, None)

    @property
    def active(self) -> bool:
        return bool(self._num_top)

    def collect(self, compute_logits, hidden: torch.Tensor, req_ids: list[str], query_start_loc: np.ndarray,
                num_computed: np.ndarray, prompt_token_ids: list[np.ndarray]) -> dict[str, LogprobsLists]:
        """Score this step's prompt positions; return the requests whose prompt is now complete.

        Args:
            compute_logits: hidden [n, H] -> logits [n, V] (the model's LM head).
            hidden: [T] x H hidden states of the step, in token order.
            req_ids: the scheduled requests in token order (len R).
            query_start_loc: [R + 1] int: request i's tokens are hidden[qsl[i]:qsl[i + 1]].
            num_computed: [R] int: position of each request's first token this step.
            prompt_token_ids: per request, its prompt ids [P] (only read for tracked ones).

        Returns:
            req_id -> LogprobsLists with P - 1 rows (prompt tokens 1 .. P - 1):
            row j = [actual token, top-1 .. top-k] ids and logprobs (natural
            log of the raw model distribution, float32 log_softmax computed in
            float32), and the actual token's 1-based rank.
        """
        done: dict[str, LogprobsLists] = {}
        for i, req_id in enumerate(req_ids):
            k = self._num_top.get(req_id)
            if k is None:
                continue
            prompt = prompt_token_ids[i]
            num_prompt = len(prompt)
            start = int(num_computed[i])
            end = start + int(query_start_loc[i + 1] - query_start_loc[i])
            last = min(end, num_prompt - 1)  # positions [start, last) predict prompt tokens
            if last > start:
                first_token = int(query_start_loc[i])
                rows = torch.arange(first_token, first_token + last - start, device=hidden.device)
                targets = torch.from_numpy(prompt[start + 1 : last + 1].astype(np.int64)).to(hidden.device)
                self._parts[req_id].append(_score(compute_logits, hidden, rows, targets, k))
            if end >= num_prompt:
                parts = self._parts.pop(req_id)
                del self._num_top[req_id]
                done[req_id] = _to_lists(parts, k)
        return done


def _score(compute_logits, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor,
           k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ids [n, k + 1] int64, logprobs [n, k + 1] float32, ranks [n] int64 of `targets` at hidden[rows]."""
    ids_out, lps_out, ranks_out = [], [], []
    for s in range(0, len(rows), _POSITIONS_PER_PASS):
        r, t = rows[s : s + _POSITIONS_PER_PASS], targets[s : s + _POSITIONS_PER_PASS]
        logprobs = compute_logits(hidden[r]).float().log_softmax(dim=-1)
        actual = logprobs.gather(1, t[:, None])
        # Rank: 1 + how many tokens are strictly more likely (as the sampled-token rank).
        ranks_out.append((logprobs > actual).sum(dim=-1) + 1)
        if k:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            ids_out.append(torch.cat([t[:, None], top_ids], dim=1))
            lps_out.append(torch.cat([actual, top_lp], dim=1))
        else:
            ids_out.append(t[:, None])
            lps_out.append(actual)
    return (torch.cat(ids_out).cpu().numpy(), torch.cat(lps_out).cpu().numpy(),
            torch.cat(ranks_out).cpu().numpy())


def _to_lists(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]], k: int) -> LogprobsLists:
    if not parts:
        return LogprobsLists([], [], [])
    ids = np.concatenate([p[0] for p in parts])
    lps = np.concatenate([p[1] for p in parts])
    ranks = np.concatenate([p[2] for p in parts])
    return LogprobsLists(ids.tolist(), lps.astype(np.float64).tolist(), ranks.tolist())
