"""Request: the scheduler's mutable view of one sequence (core/ only; no tensors).

It is built from an `EngineCoreRequest` (the wire message) when the request
enters the scheduler and never leaves the engine-core process.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from tokenmill.core.outputs import FinishReason

if TYPE_CHECKING:  # a type only: core/ never imports the process layer at run time
    from tokenmill.engine.messages import EngineCoreRequest


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


class Request:
    """One sequence being served.

    Token spans (the one scheduling counter; see docs/architecture.md):

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
            or p.structured_outputs is not None)

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
