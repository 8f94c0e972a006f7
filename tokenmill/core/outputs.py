"""What the scheduler reports after each step: new tokens per request, why a request finished, counters.

Plain dataclasses owned by `core/` (the scheduler builds them); they cross to
the front end unchanged, through the codec in `engine/messages.py`, which
also re-exports them so that every wire message can be imported from there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    """Why a request stopped. `str()` gives OpenAI's spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # client went away or engine aborted it

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens for one request from one engine step (plain data, IPC-safe)."""

    request_id: str
    new_token_ids: list[int]
    # Parallel to new_token_ids: [sampled, top1..topk] ids and logprobs, rank.
    new_logprob_token_ids: list[list[int]] | None = None
    new_logprobs: list[list[float]] | None = None
    new_sampled_token_ranks: list[int] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that matched
    num_cached_tokens: int = 0
    # On a request's first output only, when it asked for prompt_logprobs:
    # rows for prompt tokens 1 .. P - 1, [actual, top1..topk] ids and logprobs, the actual token's rank.
    prompt_logprob_token_ids: list[list[int]] | None = None
    prompt_logprobs: list[list[float]] | None = None
    prompt_token_ranks: list[int] | None = None
    # Set on a request's first output only: when the scheduler first admitted
    # it (time.time() in the core; queue time = scheduled_time - arrival_time).
    scheduled_time: float | None = None


@dataclass(slots=True)
class EngineCoreOutputs:
    """All outputs of one engine step, plus scheduler stats for metrics."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None


@dataclass(slots=True)
class SchedulerStats:
    """Counters and gauges the scheduler reports after each step."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use, [0, 1]
    num_preemptions: int = 0  # cumulative
    num_chunked_prefill_steps: int = 0  # cumulative: steps with a partial prefill
    max_num_running_reqs: int = 0  # cumulative max of running requests in a step
    prefix_cache_queries: int = 0  # cumulative prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative prompt tokens found cached
    num_steps: int = 0  # cumulative
