"""Wire format between the front end and the engine-core process (msgspec msgpack).

Every message is a two-frame zmq multipart: `[kind, payload]`, where `kind`
is one of the `MessageKind` byte strings below and `payload` is msgpack.

    front end -> core:  ADD (EngineCoreRequest) | ABORT (list[str]) | SHUTDOWN (b"")
    core -> front end:  READY (dict) | STARTUP_ERROR (str) | OUTPUTS (EngineCoreOutputs)
                        | REQUEST_ERROR ([request_id, message]) | FATAL (str)

msgspec encodes the plain dataclasses of `tokenmill.request` natively and
rebuilds them (running `__post_init__`) when decoding with the concrete type.
One field does not survive that: `SamplingParams.__post_init__` resets
`all_stop_token_ids` to `set(stop_token_ids)`, dropping the EOS ids the
front end added, so requests travel as `[request, sorted(all_stop_token_ids)]`
and the set is put back after decoding.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tokenmill.request import EngineCoreOutputs, EngineCoreRequest


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
