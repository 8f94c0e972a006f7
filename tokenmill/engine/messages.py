"""The messages that cross between the front-end and engine-core processes.

Plain dataclasses (`EngineCoreRequest` in, `EngineCoreOutputs` with
`SchedulerStats` out, `FinishReason`) and their wire format (msgspec msgpack).
This module imports only `SamplingParams` from tokenmill, so the scheduler
(which builds `EngineCoreOutputs`) and the front end both import it without
pulling in the other process's code.

Every message is a two-frame zmq multipart: `[kind, payload]`, where `kind`
is one of the `MessageKind` byte strings below and `payload` is msgpack.

    front end -> core:  ADD (EngineCoreRequest) | ABORT (list[str]) | SHUTDOWN (b"")
    core -> front end:  READY (dict) | STARTUP_ERROR (str) | OUTPUTS (EngineCoreOutputs)
                        | REQUEST_ERROR ([request_id, message]) | FATAL (str)

msgspec encodes the plain dataclasses below natively and
rebuilds them (running `__post_init__`) when decoding with the concrete type.
One field does not survive that: `SamplingParams.__post_init__` resets
`all_stop_token_ids` to `set(stop_token_ids)`, dropping the EOS ids the
front end added, so requests travel as `[request, sorted(all_stop_token_ids)]`
and the set is put back after decoding.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenmill.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request stopped. `str()` gives OpenAI's spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # client went away or engine aborted it

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


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


class MessageKind:
    """First frame of every message (bytes, short and readable in a trace)."""

    ADD = b"ADD"
    ABORT = b"ABORT"
    SHUTDOWN = b"SHUTDOWN"
    READY = b"READY"
    STARTUP_ERROR = b"STARTUP_ERROR"
    OUTPUTS = b"OUTPUTS"
    REQUEST_ERROR = b"REQUEST_ERROR"
    FATAL = b"FATAL"


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(tuple[EngineCoreRequest, list[int]])
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
_any_decoder = msgspec.msgpack.Decoder()


def encode_request(request: EngineCoreRequest) -> bytes:
    """Serialize one `EngineCoreRequest` (with its full stop-id set)."""
    stop_ids = sorted(request.sampling_params.all_stop_token_ids)
    return _encoder.encode((request, stop_ids))


def decode_request(payload: bytes) -> EngineCoreRequest:
    """Inverse of `encode_request`.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: the bytes are not an
            encoded request.
    """
    request, stop_ids = _request_decoder.decode(payload)
    request.sampling_params.all_stop_token_ids = set(stop_ids)
    return request


def encode_outputs(outputs: EngineCoreOutputs) -> bytes:
    """Serialize one step's `EngineCoreOutputs` (stats included)."""
    return _encoder.encode(outputs)


def decode_outputs(payload: bytes) -> EngineCoreOutputs:
    """Inverse of `encode_outputs`."""
    return _outputs_decoder.decode(payload)


def encode_obj(obj: Any) -> bytes:
    """Serialize a plain value (str, list, dict of builtins)."""
    return _encoder.encode(obj)


def decode_obj(payload: bytes) -> Any:
    """Inverse of `encode_obj` (builtins only)."""
    return _any_decoder.decode(payload)
