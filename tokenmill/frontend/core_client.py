"""The front end's handle on the engine-core process: spawn, handshake, send, read.

`EngineCoreClient` owns the process and the two zmq sockets (see
`core_proc.py` for the picture). It knows nothing about requests' text:
`AsyncLLM` gives it a `handler(kind, payload_obj)` and the client's reader
task calls it for every message from the core, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from tokenmill.core.request import RequestStatus
from tokenmill.engine.core_proc import core_num_threads, run_engine_core
from tokenmill.engine.messages import (
    EngineCoreRequest,
    MessageKind,
    decode_obj,
    decode_outputs,
    encode_obj,
    encode_request,
)

if TYPE_CHECKING:
    from tokenmill.config.configs import EngineConfig

logger = logging.getLogger(__name__)

_POLL_MS = 500  # reader wake-up period for checking that the core is alive
# Most queued core messages the reader takes in one go before calling `flush`:
# a bound on how long one batch keeps the event loop (16 steps of 512 requests:
# ~8k tokens to detokenize, ~0.1 s on one core).
_MAX_BATCH = 16


class EngineStartupError(RuntimeError):
    """The engine core could not start; `str()` is the reason for the user."""


class EngineDeadError(RuntimeError):
    """The engine-core process has died; no request can be served."""

    def user_message(self) -> str:
        """The sentence a client sees (HTTP 503)."""
        return f"The engine is not running: {self}"


class ServerShuttingDownError(EngineDeadError):
    """A request aborted because the server is shutting down (its grace period ran out); HTTP 503."""

    def user_message(self) -> str:
        return str(self)


Handler = Callable[[bytes, Any], None]
Flush = Callable[[], None]


class EngineCoreClient:
    """Spawns `run_engine_core` and talks to it over ipc:// sockets.

    Use: `client = EngineCoreClient(engine_config)`, `await client.start()`
    (raises `EngineStartupError`), `client.start_reader(handler)`,
    `client.add_request(req)`, `client.abort_requests(ids)`, `client.shutdown()`.

    Must stay true: once `start_reader` has run, nothing may await `_out`
    (`poll`, `recv*`). The reader puts its own `loop.add_reader` callback on
    the socket's fd, which replaces the one zmq.asyncio registered when
    `start()` awaited it, and removes it when the reader ends; an await on
    `_out` after that would never wake. `start()` is the only awaiting user,
    and it runs before the reader.
    """

    def __init__(self, engine_config: EngineConfig, num_threads: int | None = None,
                 core_class: str = "tokenmill.engine.core:EngineCore") -> None:
        self.engine_config = engine_config
        self.core_class = core_class
        device = getattr(getattr(engine_config, "device_config", None), "device", "cpu")
        self.num_threads = num_threads if num_threads is not None else core_num_threads(device=device)
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        self.input_addr = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        self.output_addr = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)  # to the core's input
        self._out = self._ctx.socket(zmq.PULL)  # from the core's output
        for sock in (self._in, self._out):
            sock.setsockopt(zmq.LINGER, 0)
            # Unlimited queues: a send must never block or drop while the core
            # is inside a long step.
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._in.bind(self.input_addr)
        self._out.bind(self.output_addr)
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._reader: asyncio.Task | None = None
        self.ready_info: dict[str, Any] = {}
        self.dead_reason: str | None = None

    @property
    def is_alive(self) -> bool:
        """True while the core process runs and has not reported a fatal error."""
        return self.dead_reason is None and self._proc is not None and self._proc.is_alive()

    def launch(self) -> None:
        """Spawn the core process and return at once (it loads the model meanwhile)."""
        if self._proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.engine_config, self.input_addr, self.output_addr, self.num_threads, self.core_class),
            name="tokenmill-engine-core",
            daemon=True,
        )
        self._proc.start()

    async def start(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Spawn the core (unless `launch()` did) and wait for READY.

        Args:
            timeout_s: give up after this many seconds (None: wait as long as
                the process lives; loading a model can take minutes).

        Returns:
            The READY facts (num_gpu_blocks, block_size, max_model_len, pid, ...).

        Raises:
            EngineStartupError: the core sent STARTUP_ERROR (its text, e.g. a
                config `ValueError`), died, or timed out.
        """
        self.launch()
        assert self._proc is not None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if await self._out.poll(_POLL_MS):
                kind, payload = await self._out.recv_multipart()
                if kind == MessageKind.READY:
                    self.ready_info = decode_obj(payload)
                    return self.ready_info
                text = decode_obj(payload) if kind in (MessageKind.STARTUP_ERROR, MessageKind.FATAL) else repr(kind)
                self.shutdown()
                raise EngineStartupError(str(text))
            if not self._proc.is_alive():
                code = self._proc.exitcode
                self.shutdown()
                raise EngineStartupError(f"The engine core process exited during start-up (exit code {code}); "
                                         "see the log above.")
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise EngineStartupError(f"The engine core did not become ready within {timeout_s:.0f} s.")

    @property
    def reader_running(self) -> bool:
        """False once the reader task has ended (or before `start_reader`)."""
        return self._reader is not None and not self._reader.done()

    def start_reader(self, handler: Handler, flush: Flush | None = None) -> None:
        """Start the task that feeds every core message to `handler(kind, obj)`.

        `obj` is an `EngineCoreOutputs` for OUTPUTS, `[request_id, message]`
        for REQUEST_ERROR, and the reason text for FATAL (also sent when the
        process vanishes without a word). Must run inside the event loop.

        The reader takes every message already queued (up to `_MAX_BATCH`),
        hands each to `handler` in order, then calls `flush()` once: a front
        end that fell behind the core catches up in one pass instead of one
        event-loop turn per step.
        """
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read_loop(handler, flush), name="tokenmill-core-reader")

    async def _read_loop(self, handler: Handler, flush: Flush | None = None) -> None:
        """Read through an event-loop reader callback on the socket's fd; this task only watches the process.

        The callback receives with the plain (synchronous) socket. At low
        concurrency one message comes per decode step and finds the loop
        idle; zmq.asyncio's poll and recv futures, the poll's timer, the
        `zmq.Again` that ended each batch and a `sleep(0)` cost 180-240 us
        of loop-thread CPU per message, this 45-70 us
        (benchmarks/zmq_reader_cpu.py) -- CPU the engine core's threads
        share on a small machine.

        zmq's fd is edge-triggered: it signals when the socket's events may
        have changed, so every callback receives until `zmq.EVENTS` shows no
        message (then the next one signals again), or hands the rest of a
        full batch to a callback of the next loop turn (which lets the
        streams send what this batch gave them first).

        The reader ends at a FATAL; when the process is found gone, after
        every message it sent (a FATAL among them is the one dead notice);
        or when `shutdown()` cancels it. Once it has ended no queued
        callback reaches `handler` (`ended` is done).
        """
        loop = asyncio.get_running_loop()
        sock = zmq.Socket.shadow(self._out.underlying)
        fd = sock.get(zmq.FD)
        ended: asyncio.Future = loop.create_future()  # result: dead; exception: the reader failed

        def drain() -> None:
            # `ended` done: the reader has ended and nothing more reaches the
            # handler (a drain queued by `call_soon` may still run). `closed`:
            # shutdown() destroyed the context; `sock` shadows a freed socket.
            if ended.done() or self._out.closed:
                return
            try:
                messages = []
                while len(messages) < _MAX_BATCH and sock.get(zmq.EVENTS) & zmq.POLLIN:
                    messages.append(sock.recv_multipart(zmq.NOBLOCK))
                if len(messages) == _MAX_BATCH:
                    loop.call_soon(drain)
                if messages and not self._dispatch(messages, handler, flush):
                    ended.set_result(None)
            except Exception as exc:  # noqa: BLE001 - ends the reader as an exception in the old task did
                ended.set_exception(exc)

        # Replaces zmq.asyncio's own callback on this fd for good (see the class docstring).
        loop.add_reader(fd, drain)
        try:
            drain()  # what arrived before the callback was registered
            while not ended.done():
                # Wakes every _POLL_MS even while messages flow, so it can land mid-backlog.
                await asyncio.wait([ended], timeout=_POLL_MS / 1000)
                if not ended.done() and self._proc is not None and not self._proc.is_alive():
                    # Everything the core sent before it exited comes first, its FATAL (and
                    # traceback) included; that FATAL ends the reader inside `drain`.
                    while not ended.done() and sock.get(zmq.EVENTS) & zmq.POLLIN:
                        drain()
                    if not ended.done():
                        ended.set_result(None)  # drains still queued by call_soon do nothing
                        self._mark_dead(handler, f"The engine core process exited (exit code {self._proc.exitcode}).")
                        return
            ended.result()  # re-raise a reader failure
        finally:
            loop.remove_reader(fd)
            if not ended.done():  # cancelled (shutdown): queued drains do nothing
                ended.cancel()

    def _dispatch(self, messages: list[list[bytes]], handler: Handler, flush: Flush | None) -> bool:
        """Decode and hand `messages` to `handler`, then flush.

        Returns False (the reader stops) after a FATAL, or once `shutdown()`
        has run (called by the handler or `flush`): no handler call follows it.
        """
        for kind, payload in messages:
            if self._out.closed:
                break
            if kind == MessageKind.OUTPUTS:
                obj: Any = decode_outputs(payload)
            else:
                obj = decode_obj(payload)
            if kind == MessageKind.FATAL:
                self._flush(flush)
                self._mark_dead(handler, str(obj))
                return False
            try:
                handler(kind, obj)
            except Exception:
                logger.exception("error while handling an engine-core message")
        self._flush(flush)
        return not self._out.closed

    @staticmethod
    def _flush(flush: Flush | None) -> None:
        if flush is None:
            return
        try:
            flush()
        except Exception:
            logger.exception("error while handling engine-core messages")

    def _mark_dead(self, handler: Handler, reason: str) -> None:
        logger.error("engine core is dead: %s", reason)
        self.dead_reason = reason
        handler(MessageKind.FATAL, reason)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request for the core (non-blocking).

        Raises:
            EngineDeadError: the core is not running.
            ValueError: the request cannot be serialized (an out-of-range value).
        """
        self._check_alive()
        try:
            payload = encode_request(request)
        except (OverflowError, TypeError, ValueError) as exc:  # msgspec.EncodeError is a ValueError
            # e.g. an integer above 64 bits inside a JSON schema: the client's
            # mistake, refused before it reaches the core.
            raise ValueError(f"The request holds a value the engine cannot carry: {exc}.") from None
        self._in.send_multipart([MessageKind.ADD, payload])

    def abort_requests(self, request_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """Tell the core to finish these requests and free their blocks (no-op if dead).

        Args:
            status: FINISHED_ABORTED (client gone) or FINISHED_STOPPED (a stop
                string matched in the front end).
        """
        if request_ids and self.is_alive:
            self._in.send_multipart([MessageKind.ABORT, encode_obj([list(request_ids), int(status)])])

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise EngineDeadError(self.dead_reason or "The engine core process is not running.")

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the reader, ask the core to exit, then make sure it does."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        proc = self._proc
        if proc is not None and proc.is_alive():
            # A synchronous twin of the async socket: works outside the event
            # loop, and fails at once (terminate() below covers it) if the
            # core is no longer connected.
            with contextlib.suppress(zmq.ZMQError):
                zmq.Socket.shadow(self._in.underlying).send_multipart([MessageKind.SHUTDOWN, b""],
                                                                      flags=zmq.NOBLOCK)
            proc.join(timeout_s)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if not self._ctx.closed:
            # destroy() closes every socket first; term() alone would wait
            # for sockets a cancelled poll may still hold.
            self._ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)
