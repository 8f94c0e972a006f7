"""Sampled-token logprobs from the engine core -> vLLM's per-token dicts of `Logprob`."""

from __future__ import annotations

from typing import Any

from tokenmill.frontend.detokenizer import decode_tokens_one_by_one
from tokenmill.outputs import Logprob, PositionLogprobs


def make_position_logprobs(tokenizer: Any, logprob_token_ids: list[int], logprobs: list[float],
                           sampled_rank: int) -> PositionLogprobs:
    """One generated position: [sampled, top1..topk] -> {token_id: Logprob}.

    Args:
        tokenizer: for `decoded_token` (None: decoded_token stays None).
        logprob_token_ids: [1 + k] ids, the sampled token first, then the top-k
            in decreasing probability.
        logprobs: [1 + k] natural-log probabilities, parallel to the ids.
        sampled_rank: 1-based vocabulary rank of the sampled token.

    Returns:
        A dict with the sampled token first. When the sampled token is also in
        the top-k it appears once (its rank then equals its top-k rank), so the
        dict holds k or k + 1 entries, as in vLLM.
    """
    texts = decode_tokens_one_by_one(tokenizer, logprob_token_ids) if tokenizer is not None \
        else [None] * len(logprob_token_ids)
    out: PositionLogprobs = {
        logprob_token_ids[0]: Logprob(logprobs[0], sampled_rank, texts[0]),
    }
    for rank, (tid, lp, text) in enumerate(zip(logprob_token_ids[1:], logprobs[1:], texts[1:]), start=1):
        out.setdefault(tid, Logprob(lp, rank, text))
    return out


def make_step_logprobs(tokenizer: Any, new_logprob_token_ids: list[list[int]], new_logprobs: list[list[float]],
                       new_sampled_token_ranks: list[int]) -> list[PositionLogprobs]:
    """All positions one engine step produced for a request (parallel lists, one row per token)."""
    return [
        make_position_logprobs(tokenizer, ids, lps, rank)
        for ids, lps, rank in zip(new_logprob_token_ids, new_logprobs, new_sampled_token_ranks)
    ]
