"""The messages that cross between the front-end and engine-core processes.

Plain dataclasses (`EngineCoreRequest` in, `EngineCoreOutputs` with
`SchedulerStats` out, `FinishReason`) and their wire format (msgspec msgpack).
The output types are defined in `core/outputs.py` (the scheduler builds
them; `core/` never imports this module) and re-exported here. This module
imports only those and `SamplingParams` from tokenmill, so both processes
import it without pulling in the other's code.

Every message is a two-frame zmq multipart: `[kind, payload]`, where `kind`
is one of the `MessageKind` byte strings below and `payload` is msgpack.

    front end -> core:  ADD (EngineCoreRequest) | ABORT ([request_ids, status]) | SHUTDOWN (b"")
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

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.outputs import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from tokenmill.sampling_params import SamplingParams

# The scheduler's outputs are defined in core/ (it builds them) and re-exported here: every message that
# crosses between the processes can be imported from this one module.
__all__ = ["EngineCoreOutput", "EngineCoreOutputs", "EngineCoreRequest", "FinishReason", "MessageKind",
           "SchedulerStats", "decode_obj", "decode_outputs", "decode_request", "encode_obj", "encode_outputs",
           "encode_request"]


@dataclass(slots=True)
class EngineCoreRequest:
    """A tokenized request as it enters the engine core (plain data, IPC-safe)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    cache_salt: str | None = None


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


@functools.cache
def _codec() -> tuple[Any, Any, Any, Any]:
    """(encoder, request decoder, outputs decoder, any decoder), built at first use.

    msgspec is imported here, not at module import: it comes with the `serve` extra, and the
    offline `LLM` (one process) uses the message types without ever encoding them.
    """
    import msgspec

    return (msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(tuple[EngineCoreRequest, list[int]]),
            msgspec.msgpack.Decoder(EngineCoreOutputs), msgspec.msgpack.Decoder())


def encode_request(request: EngineCoreRequest) -> bytes:
    """Serialize one `EngineCoreRequest` (with its full stop-id set)."""
    stop_ids = sorted(request.sampling_params.all_stop_token_ids)
    return _codec()[0].encode((request, stop_ids))


def decode_request(payload: bytes) -> EngineCoreRequest:
    """Inverse of `encode_request`.

    Raises:
        msgspec.DecodeError / msgspec.ValidationError: the bytes are not an
            encoded request.
    """
    request, stop_ids = _codec()[1].decode(payload)
    request.sampling_params.all_stop_token_ids = set(stop_ids)
    return request


def encode_outputs(outputs: EngineCoreOutputs) -> bytes:
    """Serialize one step's `EngineCoreOutputs` (stats included)."""
    return _codec()[0].encode(outputs)


def decode_outputs(payload: bytes) -> EngineCoreOutputs:
    """Inverse of `encode_outputs`."""
    return _codec()[2].decode(payload)


def encode_obj(obj: Any) -> bytes:
    """Serialize a plain value (str, list, dict of builtins)."""
    return _codec()[0].encode(obj)


def decode_obj(payload: bytes) -> Any:
    """Inverse of `encode_obj` (builtins only)."""
    return _codec()[3].decode(payload)
