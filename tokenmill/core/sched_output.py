"""The two plain-data contracts between the scheduler (core/) and the worker.

`SchedulerOutput` goes scheduler -> worker once per step; `ModelRunnerOutput`
comes back. Neither holds a tensor or a `Request`: only ints, lists and
`SamplingParams`, so both can cross a process boundary unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen yet, or one resumed after preemption.

    A resumed request comes again in full: the worker dropped it when it was
    preempted, and its KV must be recomputed from `num_computed_tokens`
    (which the scheduler reset, possibly to a prefix-cache hit length).
    """

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; [] for a brand-new request.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    # The request's whole block table so far (block ids, in order).
    block_ids: list[int]
    # Tokens whose KV is already in the cache (prefix-cache hits included).
    num_computed_tokens: int
    # Its sliding-window group table (KVCacheManager's second group; [] without one).
    swa_block_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class CachedRequestData:
    """Requests already in the worker's batch, sent as diffs (parallel lists)."""

    req_ids: list[str] = field(default_factory=list)
    # Block ids appended to each request's block table this step ([] if none).
    new_block_ids: list[list[int]] = field(default_factory=list)
    # num_computed_tokens before this step's tokens are computed.
    num_computed_tokens: list[int] = field(default_factory=list)
    # With a sliding-window group only (else empty): block ids appended to each request's
    # sliding-window table this step ([] if none).
    new_swa_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What to run in one step.

    Invariant: for every scheduled request, the tokens to compute this step
    are token positions [num_computed_tokens, num_computed_tokens +
    num_scheduled_tokens[req_id]) of prompt + output. The worker samples a
    token for a request only when that span reaches the end of its known
    tokens (the last prompt token, or the last sampled token).
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> num_scheduled_tokens this step
    num_scheduled_tokens: dict[str, int]
    # sum(num_scheduled_tokens.values())
    total_num_scheduled_tokens: int
    # Requests that finished or were aborted/preempted since the last step:
    # the worker drops their state. (Preempted ones may come back later as new.)
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured output (filled by the engine core after scheduling):
    # req_id -> row of grammar_bitmask, for scheduled requests under a grammar.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    # [len(structured_output_request_ids), ceil(vocab_size / 32)] int32 NumPy
    # array; bit j of word w set = token 32 * w + j allowed. None when unused.
    grammar_bitmask: Any = None


@dataclass(slots=True)
class LogprobsLists:
    """Top-k logprobs of sampled tokens, one row per request that sampled.

    Row i: `logprob_token_ids[i]` = [sampled_id, top1_id, ..., topk_id],
    `logprobs[i]` the matching log-probabilities (float, natural log, of the
    raw model distribution before temperature/penalties, as vLLM's default
    `logprobs_mode`), `sampled_token_ranks[i]` the 1-based rank of the sampled
    token in the vocabulary.
    """

    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one step produced (worker -> scheduler)."""

    # Order of the rows below.
    req_ids: list[str]
    # req_id -> row index in the lists below
    req_id_to_index: dict[str, int]
    # One list per request: [token] if it sampled this step, [] if it was a
    # partial prefill chunk that produced no token.
    sampled_token_ids: list[list[int]]
    # Row i for req_ids[i]; None when no request in the step asked for logprobs.
    # Rows of requests that did not sample or did not ask are empty lists.
    logprobs: LogprobsLists | None = None
    # req_id -> prompt logprobs (rows for prompt tokens 1 .. P - 1, the actual
    # token first in each row), for requests whose prompt finished this step
    # and that asked for prompt_logprobs; gathered over all prefill chunks.
    prompt_logprobs_dict: dict[str, LogprobsLists] = field(default_factory=dict)
