"""Sampler: logits -> next token ids (+ logprobs), one row per request that samples.

Order of transforms (as vLLM v1): raw logits -> [logprobs of the raw
distribution] -> allowed_token_ids / min_tokens masks, logit_bias ->
penalties -> greedy argmax, or temperature -> top-k/top-p -> softmax ->
min-p -> exponential-race sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.sample.metadata import SamplingMetadata
from tokenmill.sample.ops import apply_min_p, apply_penalties, apply_top_k_top_p, argmax_rows


@dataclass(slots=True)
class SamplerOutput:
    # [S] int64 sampled token ids.
    sampled_token_ids: torch.Tensor
    # [S, k + 1] int64: sampled id then the top-k ids (k = max_num_logprobs); None without logprobs.
    logprob_token_ids: torch.Tensor | None = None
    # [S, k + 1] float32 matching log-probabilities of the raw logits.
    logprobs: torch.Tensor | None = None
    # [S] int64: 1-based rank of the sampled token in the raw distribution.
    sampled_token_ranks: torch.Tensor | None = None


class Sampler:
    """Stateless; all per-request state comes in `SamplingMetadata`."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [S, V] float32 raw model logits (not modified).
            md: the step's sampling metadata with S rows.

        Returns:
            SamplerOutput; logprob fields are set when md.max_num_logprobs is not None.
        """
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = self._process_logits(logits.float(), md)
        sampled = self._sample(logits, md)
        if raw_logprobs is None:
            return SamplerOutput(sampled)
        ids, lps, ranks = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled, ids, lps, ranks)

    @staticmethod
    def _process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        copied = False
        if md.disallowed_mask is not None:
            logits = logits.masked_fill(md.disallowed_mask, float("-inf"))
            copied = True
        if md.min_tokens_mask is not None or md.logit_bias is not None:
            if not copied:
                logits = logits.clone()
                copied = True
            if md.min_tokens_mask is not None:
                rows, ids = md.min_tokens_mask
                logits[rows, ids] = float("-inf")
            if md.logit_bias is not None:
                rows, ids, bias = md.logit_bias
                logits.index_put_((rows, ids), bias, accumulate=True)
        if md.repetition_penalty is not None:
            assert md.output_token_counts is not None and md.prompt_token_mask is not None
            logits = apply_penalties(
                logits if copied else logits.clone(),
                md.output_token_counts,
                md.prompt_token_mask,
                md.presence_penalty,
                md.frequency_penalty,
                md.repetition_penalty,
            )
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:
            return argmax_rows(logits)
        assert md.temperature is not None
        scaled = logits / md.temperature[:, None]
        if md.top_k is not None or md.top_p is not None:
            scaled = apply_top_k_top_p(scaled, md.top_k, md.top_p, md.max_top_k)
        probs = scaled.softmax(dim=-1)
        if md.min_p is not None:
            probs = apply_min_p(probs, md.min_p)
        random = exponential_race(probs, md.generators)
        if md.all_random:
            return random
        return torch.where(md.greedy_mask, argmax_rows(logits), random)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one index per row of `probs` [S, V] as argmax(probs / q), q ~ Exp(1).

    argmax_i p_i / q_i is distributed as Categorical(p) (the "exponential
    race" / Gumbel-max trick in another form). Rows with a generator draw
    their whole q row from it, so a seeded request's tokens do not depend
    on the batch. Returns [S] int64.
    """
    q = torch.empty_like(probs)
    q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return argmax_rows(probs.div(q))


def gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled token's logprob and rank, plus the top-k.

    logprobs [S, V] float32 log-probabilities, sampled [S] int64, k >= 0.
    Returns ids [S, k + 1] int64 (sampled first), values [S, k + 1] float32,
    ranks [S] int64 (1 = most likely; ties rank by strictly-greater count).
    """
    sampled_lp = logprobs.gather(1, sampled[:, None])
    ranks = (logprobs > sampled_lp).sum(dim=-1) + 1
    if k == 0:
        return sampled[:, None], sampled_lp, ranks
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    ids = torch.cat([sampled[:, None], top_ids], dim=1)
    return ids, torch.cat([sampled_lp, top_lp], dim=1), ranks
