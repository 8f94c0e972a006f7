"""SamplingState: per-row sampling parameters of the persistent batch, and the step's metadata.

Rows follow the `InputBatch` rows (added, moved, cleared together). Scalar
parameters live in NumPy arrays so one step's `SamplingMetadata` is a
gather over the sampling rows plus a host->device copy, not a loop over
`SamplingParams` objects.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill.sample.bad_words import bad_word_masked_ids
from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sampling_params import SamplingParams


class SamplingState:
    """Sampling parameters by batch row.

    Args:
        max_num_reqs: rows.
        vocab_size: V, the logits' width.
        device: where the metadata tensors go.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        r = max_num_reqs
        self.temperature = np.ones(r, np.float32)  # 0 = greedy
        self.top_k = np.zeros(r, np.int64)  # 0 = off
        self.top_p = np.ones(r, np.float32)
        self.min_p = np.zeros(r, np.float32)
        self.presence = np.zeros(r, np.float32)
        self.frequency = np.zeros(r, np.float32)
        self.repetition = np.ones(r, np.float32)
        self.min_tokens = np.zeros(r, np.int64)
        self.num_logprobs = np.full(r, -1, np.int64)  # -1 = no logprobs
        # Rows with a logit_bias / allowed_token_ids / stop ids under min_tokens: only these are visited per step.
        self.has_sparse = np.zeros(r, bool)
        self.params: list[SamplingParams | None] = [None] * r
        self.generators: list[torch.Generator | None] = [None] * r
        # Bumped by add/move/clear; with the rows array it keys the metadata cache below.
        self._version = 0
        # (rows array, version, metadata) of the last step whose metadata does not
        # change from step to step (no penalties, no logit_bias / allowed ids /
        # min_tokens rows): the next step with the same rows object reuses it.
        self._md_cache: tuple[np.ndarray, int, SamplingMetadata] | None = None

    def add(self, row: int, params: SamplingParams, num_output_tokens: int) -> None:
        """Set `row` from `params`; a seeded request resumed after `num_output_tokens`
        tokens gets its generator advanced past the draws it already made."""
        self.params[row] = params
        self.temperature[row] = 0.0 if params.sampling_type_greedy else params.temperature
        self.top_k[row] = params.top_k
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.presence[row] = params.presence_penalty
        self.frequency[row] = params.frequency_penalty
        self.repetition[row] = params.repetition_penalty
        self.min_tokens[row] = params.min_tokens
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.has_sparse[row] = bool(params.logit_bias) or params.allowed_token_ids is not None or (
            params.min_tokens > 0 and bool(_min_tokens_ids(params))
        ) or bool(params.bad_words_token_ids)
        gen = None
        if params.seed is not None and not params.sampling_type_greedy:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
            # Each sampled token consumed one row of V exponentials (see exponential_race).
            scratch = torch.empty(self.vocab_size, device=self.device)
            for _ in range(num_output_tokens):
                scratch.exponential_(generator=gen)
        self.generators[row] = gen

    def move(self, src: int, dst: int) -> None:
        """Copy row `src` onto row `dst` (batch compaction)."""
        self._version += 1
        for arr in (self.temperature, self.top_k, self.top_p, self.min_p, self.presence,
                    self.frequency, self.repetition, self.min_tokens, self.num_logprobs, self.has_sparse):
            arr[dst] = arr[src]
        self.params[dst] = self.params[src]
        self.generators[dst] = self.generators[src]

    def clear(self, row: int) -> None:
        self._version += 1
        self.params[row] = None
        self.generators[row] = None

    def make_metadata(
        self,
        rows: np.ndarray,  # [S] batch rows that sample this step, in logits order
        token_ids: np.ndarray,  # [R, max_model_len] int32 prompt + output per row
        num_prompt_tokens: np.ndarray,  # [R] int
        num_tokens: np.ndarray,  # [R] int: prompt + output (before this step's sample)
    ) -> SamplingMetadata:
        """Build the step's `SamplingMetadata` for `rows`; passes nobody needs are None.

        When `rows` is the very array of the previous call (InputBatch hands
        out the same array while the batch is unchanged), no row was set
        since, and nothing in the metadata depends on the tokens so far, the
        previous metadata object is returned again (no new device tensors).
        The sampler only reads it.
        """
        cache = self._md_cache
        if cache is not None and cache[0] is rows and cache[1] == self._version:
            return cache[2]
        dev = self.device
        temp = self.temperature[rows]
        greedy = temp == 0.0
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        md = SamplingMetadata(
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=None if all_greedy else _to(np.where(greedy, 1.0, temp).astype(np.float32), dev),
            greedy_mask=None if all_greedy or all_random else _to(greedy, dev),
            top_k=None,
            top_p=None,
            min_p=None,
        )
        if not all_greedy:
            top_k = self.top_k[rows]
            if (top_k > 0).any():
                k = np.where(top_k > 0, np.minimum(top_k, self.vocab_size), self.vocab_size)
                md.top_k = _to(k, dev)
                md.max_top_k = int(k.max())
            top_p = self.top_p[rows]
            if (top_p < 1.0).any():
                md.top_p = _to(top_p, dev)
            min_p = self.min_p[rows]
            if (min_p > 0.0).any():
                md.min_p = _to(min_p, dev)
            md.generators = {i: g for i, r in enumerate(rows.tolist()) if (g := self.generators[r]) is not None}
        num_out = num_tokens[rows] - num_prompt_tokens[rows]
        pres, freq, rep = self.presence[rows], self.frequency[rows], self.repetition[rows]
        if (pres != 0).any() or (freq != 0).any() or (rep != 1).any():
            md.presence_penalty, md.frequency_penalty, md.repetition_penalty = _to(pres, dev), _to(freq, dev), _to(rep, dev)
            md.output_token_counts = self._token_counts(token_ids[rows], num_prompt_tokens[rows], num_tokens[rows])
            md.prompt_token_mask = self._token_counts(token_ids[rows], np.zeros_like(num_out), num_prompt_tokens[rows]) > 0
        if self.has_sparse[rows].any():
            self._add_masks(md, rows, num_out, token_ids, num_prompt_tokens)
        num_lp = self.num_logprobs[rows]
        if (num_lp >= 0).any():
            md.max_num_logprobs = int(num_lp.max())
        step_dependent = md.output_token_counts is not None or self.has_sparse[rows].any()
        self._md_cache = None if step_dependent else (rows, self._version, md)
        return md

    def _add_masks(self, md: SamplingMetadata, rows: np.ndarray, num_out: np.ndarray, token_ids: np.ndarray,
                   num_prompt_tokens: np.ndarray) -> None:
        """logit_bias, allowed_token_ids, min_tokens and bad_words: sparse, built only for rows that use them."""
        bias_rows, bias_ids, bias_vals, stop_rows, stop_ids, allowed = [], [], [], [], [], []
        for i in np.flatnonzero(self.has_sparse[rows]).tolist():
            r = int(rows[i])
            p = self.params[r]
            assert p is not None
            if p.logit_bias:
                for tok, b in p.logit_bias.items():
                    if 0 <= int(tok) < self.vocab_size:
                        bias_rows.append(i)
                        bias_ids.append(int(tok))
                        bias_vals.append(float(b))
            if p.allowed_token_ids is not None:
                allowed.append((i, p.allowed_token_ids))
            ids = []
            if num_out[i] < self.min_tokens[r]:
                ids = [t for t in _min_tokens_ids(p) if t < self.vocab_size]
            if p.bad_words_token_ids:
                # Only the last (longest bad word - 1) generated tokens can match a prefix: read those, not the
                # whole output, each step.
                end = int(num_prompt_tokens[r]) + int(num_out[i])
                keep = max(len(seq) for seq in p.bad_words_token_ids) - 1
                out_ids = token_ids[r, max(int(num_prompt_tokens[r]), end - keep) : end].tolist()
                ids += bad_word_masked_ids(p.bad_words_token_ids, out_ids)
            stop_rows += [i] * len(ids)
            stop_ids += ids
        dev = self.device
        if bias_rows:
            md.logit_bias = (_to(np.array(bias_rows), dev), _to(np.array(bias_ids), dev),
                             _to(np.array(bias_vals, np.float32), dev))
        if stop_rows:
            md.min_tokens_mask = (_to(np.array(stop_rows), dev), _to(np.array(stop_ids), dev))
        if allowed:
            mask = np.zeros((len(rows), self.vocab_size), bool)
            for i, ids in allowed:
                mask[i] = True
                mask[i, [t for t in ids if 0 <= t < self.vocab_size]] = False
            md.disallowed_mask = _to(mask, dev)

    def _token_counts(self, tokens: np.ndarray, start: np.ndarray, end: np.ndarray) -> torch.Tensor:
        """[S, V] float32 counts of tokens[i, start[i]:end[i]] per row, without a Python loop.

        Out-of-span entries are sent to an extra column V that is dropped:
        tokens [[7, 8, 8]], start [1], end [3] -> ids [[V, 8, 8]] -> counts[0, 8] = 2
        """
        width = int((end - start).max()) if len(end) else 0
        counts = torch.zeros(len(start), self.vocab_size + 1, device=self.device)
        if width == 0:
            return counts[:, : self.vocab_size]
        cols = start[:, None] + np.arange(width)[None]  # [S, width]
        inside = cols < end[:, None]
        ids = np.take_along_axis(tokens, np.minimum(cols, tokens.shape[1] - 1), axis=1).astype(np.int64)
        ids = np.where(inside & (ids < self.vocab_size), ids, self.vocab_size)
        ids_t = _to(ids, self.device)
        counts.scatter_add_(1, ids_t, torch.ones(ids_t.shape, device=self.device))
        return counts[:, : self.vocab_size]


def _min_tokens_ids(params: SamplingParams) -> set[int]:
    """Ids masked while fewer than min_tokens are out: the stop ids and EOS, even under ignore_eos (vLLM's rule)."""
    if params.eos_token_id is None:
        return params.all_stop_token_ids
    return params.all_stop_token_ids | {params.eos_token_id}


def _to(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
