"""Request: the scheduler's view of one sequence (core/ only; no tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams
from tokenmill.structured_output.spec import EXTRA_ARGS_KEY as STRUCTURED_OUTPUTS_KEY


class FinishReason(enum.IntEnum):
    """Why a request stopped. `str()` gives OpenAI's spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # client went away or engine aborted it

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
        }.get(status)


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized request as it enters the engine core (plain data, IPC-safe)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None


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


class Request:
    """One sequence being served.

    Token spans (the one scheduling counter; see DESIGN.md):

        | prompt_token_ids | output_token_ids |
        |<---- num_computed_tokens ---->|<- to compute ->|
                                        num_tokens = len(all_token_ids)

    Attributes:
        request_id, prompt_token_ids, sampling_params, arrival_time, priority,
        cache_salt: from the `EngineCoreRequest`.
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens whose KV is in the cache.
        num_cached_tokens: prompt tokens served from the prefix cache at first
            schedule (-1 until scheduled).
        num_preemptions: times this request was preempted.
        block_hashes: hashes of the request's full blocks (prefix caching).
        num_output_placeholders: tokens scheduled to be sampled whose ids are
            not known yet (async scheduling: the step that samples them is
            still running while the next one is scheduled): at most 2, between
            scheduling step N+1 and reading step N back.
        needs_sync: its sampling reads the tokens generated so far (penalties,
            min_tokens, bad_words, structured output), so steps holding it are not
            scheduled ahead of their results.
    """

    # Slots: the scheduler touches every running request each step; no
    # per-object __dict__ keeps that walk over fewer cache lines.
    __slots__ = ("all_token_ids", "arrival_time", "block_hashes", "cache_salt", "max_tokens", "needs_sync",
                 "num_cached_tokens", "num_computed_tokens", "num_output_placeholders", "num_preemptions", "output_token_ids", "priority", "prompt_token_ids",
                 "request_id", "sampling_params", "scheduled_time", "status", "stop_reason")

    def __init__(self, req: EngineCoreRequest, max_tokens: int) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.sampling_params = req.sampling_params
        self.arrival_time = req.arrival_time
        self.priority = req.priority
        self.cache_salt = req.cache_salt
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.scheduled_time: float | None = None  # first admission (time.time()), for queue-time metrics
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        self.num_output_placeholders = 0
        p = req.sampling_params
        self.needs_sync = bool(
            p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.min_tokens or p.bad_words
            or (p.extra_args and p.extra_args.get(STRUCTURED_OUTPUTS_KEY)))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority order (vLLM): smaller priority first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
