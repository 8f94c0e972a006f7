"""The engine-core process and its client, with a scripted core (no model): wire format,
start-up handshake, batching of requests, aborts, per-request errors, and core death."""

from __future__ import annotations

import asyncio
import time

import pytest
from fake_core import make_config

from tokenmill.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    MessageKind,
    SchedulerStats,
    decode_outputs,
    decode_request,
    encode_obj,
    encode_outputs,
    encode_request,
)
from tokenmill.frontend.core_client import EngineCoreClient, EngineDeadError, EngineStartupError
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

FAKE = "fake_core:FakeCore"


def _request(rid: str, max_tokens: int = 3, first_token: int = 1) -> EngineCoreRequest:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["x"], logit_bias={5: -1.5},
                        output_kind=RequestOutputKind.DELTA, seed=3)
    sp.update_from_generation_config({"eos_token_id": [9, 10]}, 2)
    return EngineCoreRequest(rid, [first_token, 2, 3], sp, priority=1, cache_salt="s")


def test_request_round_trip_keeps_eos_ids_enums_and_int_keys():
    req = _request("a")
    back = decode_request(encode_request(req))
    assert back == req
    assert back.sampling_params.all_stop_token_ids == {2, 9, 10}
    assert back.sampling_params.output_kind is RequestOutputKind.DELTA
    assert back.sampling_params.logit_bias == {5: -1.5}


def test_outputs_round_trip():
    outs = EngineCoreOutputs([EngineCoreOutput("a", [4], [[4, 1]], [[-0.1, -2.0]], [1], FinishReason.STOP, "x", 16)],
                             12.5, SchedulerStats(num_running_reqs=3, kv_cache_usage=0.25))
    back = decode_outputs(encode_outputs(outs))
    assert back == outs and back.outputs[0].finish_reason is FinishReason.STOP


class Collector:
    """Handler that records outputs per request and the last stats."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.errors: dict[str, str] = {}
        self.stop_reasons: set[object] = set()
        self.fatal: str | None = None
        self.stats: SchedulerStats | None = None

    def __call__(self, kind: bytes, obj) -> None:
        if kind == MessageKind.OUTPUTS:
            self.stats = obj.scheduler_stats
            for o in obj.outputs:
                self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                self.stop_reasons.add(o.stop_reason)
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        elif kind == MessageKind.REQUEST_ERROR:
            self.errors[obj[0]] = obj[1]
        elif kind == MessageKind.FATAL:
            self.fatal = obj


async def _wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_startup_value_error_reaches_the_front_end():
    async def run() -> None:
        client = EngineCoreClient(make_config("bad_config"), num_threads=1, core_class=FAKE)
        with pytest.raises(EngineStartupError, match="use at most 192"):
            await client.start(timeout_s=120)
        assert not client.is_alive
        assert client._proc.exitcode == 1  # a failed start is not a clean exit

    asyncio.run(run())


def test_requests_are_batched_aborted_and_refused_individually():
    async def run() -> None:
        client = EngineCoreClient(make_config(), num_threads=1, core_class=FAKE)
        info = await client.start(timeout_s=120)
        assert info["max_model_len"] == 128 and info["block_size"] == 16
        got = Collector()
        client.start_reader(got)
        try:
            for i in range(4):
                client.add_request(_request(f"r{i}", max_tokens=5))
            client.add_request(_request("long", max_tokens=10_000))
            client.add_request(_request("bad", first_token=666))
            await _wait_for(lambda: {"r0", "r1", "r2", "r3"} <= got.finished)
            assert all(got.tokens[f"r{i}"] == [0, 1, 2, 3, 4] for i in range(4))
            assert got.stop_reasons == {2}  # EOS id 2 survived serialization
            assert "666" in got.errors["bad"]
            # Sent while the first step ran, the five valid ones share later steps.
            assert got.stats is not None and got.stats.max_num_running_reqs == 5
            client.abort_requests(["long"])
            await _wait_for(lambda: got.stats.num_running_reqs == 0 or "long" in got.finished)
            assert "long" not in got.finished
            assert client.is_alive
        finally:
            client.shutdown()
        assert not client.is_alive
        assert client._proc.exitcode == 0  # SHUTDOWN: a clean exit

    asyncio.run(run())


def test_core_crash_is_reported_and_client_refuses_new_work():
    async def run() -> None:
        client = EngineCoreClient(make_config("crash_on_step"), num_threads=1, core_class=FAKE)
        await client.start(timeout_s=120)
        got = Collector()
        client.start_reader(got)
        try:
            client.add_request(_request("r0"))
            await _wait_for(lambda: got.fatal is not None)
            assert "simulated kernel failure" in got.fatal
            assert not client.is_alive
            with pytest.raises(EngineDeadError):
                client.add_request(_request("r1"))
            client._proc.join(60)
            assert client._proc.exitcode == 1  # exited after its FATAL
        finally:
            client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("num_cpus, expected", [(1, 1), (2, 2), (7, 7), (8, 7), (64, 63)])
def test_core_threads_take_small_machines_whole_and_leave_big_ones_a_front_end_cpu(monkeypatch, num_cpus, expected):
    from tokenmill.engine.core_proc import RESERVE_FRONT_END_CPU_FROM, core_num_threads

    monkeypatch.delenv("TOKENMILL_CPU_THREADS", raising=False)
    assert RESERVE_FRONT_END_CPU_FROM == 8
    assert core_num_threads(num_cpus) == expected
    assert core_num_threads(num_cpus, device="cuda") == max(1, num_cpus - 1)  # a GPU's host work: old rule
    monkeypatch.setenv("TOKENMILL_CPU_THREADS", "3")
    assert core_num_threads(num_cpus) == 3 and core_num_threads(num_cpus, device="cuda") == 3


@pytest.mark.parametrize("user, expected", [
    ({}, {"GOMP_SPINCOUNT": "30000"}),  # neither set: a bounded spin, not PASSIVE's sleep per region
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),  # the user's policy stands alone
    ({"GOMP_SPINCOUNT": "500"}, {"GOMP_SPINCOUNT": "500"}),
])
def test_engine_core_wait_policy_default_keeps_the_users_choice(user, expected):
    from tokenmill.engine.core_proc import set_omp_wait_default

    environ = dict(user)
    set_omp_wait_default(environ)
    assert environ == expected


def _outputs(rid: str, i: int) -> list[bytes]:
    return [MessageKind.OUTPUTS, encode_outputs(EngineCoreOutputs(
        [EngineCoreOutput(rid, [i])], scheduler_stats=SchedulerStats(num_steps=i)))]


def _inproc_pusher(client: EngineCoreClient):
    """A PUSH socket in the client's zmq context, connected over inproc:// to the client's PULL socket.

    inproc delivers a message into the pipe before `send` returns, so a backlog pushed here is whole in the
    client's queue when the reader starts: no sleep, no race with the ipc:// connection. Close it before
    `client.shutdown()` (whose context `term()` waits for every socket of the context).
    """
    import zmq

    addr = f"inproc://{client._tmpdir}"
    client._out.bind(addr)
    push = zmq.Context.shadow(client._ctx.underlying).socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(addr)
    return push


def test_reader_takes_a_backlog_in_batches_and_wakes_for_each_later_message():
    """The reader callback drains a queue longer than one batch over several loop turns (zmq's fd signals
    once for all of it) and is woken again by each message that arrives once the queue is empty."""
    import types

    import zmq

    from tokenmill.frontend import core_client

    async def run() -> None:
        client = EngineCoreClient(types.SimpleNamespace(), num_threads=1)  # no process: sockets play the core
        backlog_push = _inproc_pusher(client)
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)  # later messages come over the real ipc:// transport
        push.connect(client.output_addr)
        flushes: list[int] = []
        got = Collector()
        try:
            backlog = 2 * core_client._MAX_BATCH + 3
            for i in range(backlog):  # queued before the reader starts
                backlog_push.send_multipart(_outputs("a", i))
            client.start_reader(got, lambda: flushes.append(len(got.tokens.get("a", []))))
            await _wait_for(lambda: len(got.tokens.get("a", [])) == backlog)
            assert got.tokens["a"] == list(range(backlog))  # complete and in order
            steps = [b - a for a, b in zip([0, *flushes], flushes)]
            # One flush per batch of at most _MAX_BATCH: a backlog of 35 takes at least 3.
            assert len(steps) >= 3 and all(1 <= n <= core_client._MAX_BATCH for n in steps), flushes
            assert got.stats.num_steps == backlog - 1
            for i in range(3):  # one at a time, each after the reader went idle
                push.send_multipart([MessageKind.OUTPUTS, encode_outputs(EngineCoreOutputs(
                    [EngineCoreOutput("b", [i])]))])
                await _wait_for(lambda: len(got.tokens.get("b", [])) == i + 1)
            assert got.tokens["b"] == [0, 1, 2]
            push.send_multipart([MessageKind.FATAL, encode_obj("boom")])
            await _wait_for(lambda: not client.reader_running)
            assert got.fatal == "boom" and client.dead_reason == "boom"
        finally:
            backlog_push.close(linger=0)
            push.close(linger=0)
            ctx.term()
            client.shutdown()

    asyncio.run(run())


class _ExitedProcess:
    """Stands in for a core process that has exited (cleanly: exit code 0)."""

    exitcode = 0

    def is_alive(self) -> bool:
        return False


def test_dying_cores_backlog_is_read_whole_and_its_fatal_is_the_only_dead_notice(monkeypatch):
    """A core that sent more than a batch of outputs, then FATAL, then exited: the liveness check finds the
    process gone mid-backlog. The reader must hand over every output, then the core's own text once, and
    nothing after it (no "exited (exit code 0)" notice, no outputs from a drain queued before the end)."""
    import types

    from tokenmill.frontend import core_client

    monkeypatch.setattr(core_client, "_POLL_MS", 1)  # the check lands between batches

    async def run() -> None:
        client = EngineCoreClient(types.SimpleNamespace(), num_threads=1)
        push = _inproc_pusher(client)
        client._proc = _ExitedProcess()
        seen: list[tuple[bytes, object]] = []

        def handler(kind: bytes, obj) -> None:
            seen.append((kind, obj))
            if kind == MessageKind.OUTPUTS:
                time.sleep(0.002)  # a slow front end: the check's timer expires during each batch

        try:
            for i in range(100):
                push.send_multipart(_outputs("a", i))
            push.send_multipart([MessageKind.FATAL, encode_obj("Traceback: simulated kernel failure")])
            client.start_reader(handler)
            await _wait_for(lambda: not client.reader_running)
            for _ in range(20):  # let drains queued by call_soon run, if any are left
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            kinds = [k for k, _ in seen]
            fatals = [obj for k, obj in seen if k == MessageKind.FATAL]
            assert fatals == ["Traceback: simulated kernel failure"], fatals
            assert kinds.index(MessageKind.FATAL) == len(kinds) - 1 == 100  # nothing after it
            assert [obj.outputs[0].new_token_ids[0] for _, obj in seen[:-1]] == list(range(100))
            assert client.dead_reason == "Traceback: simulated kernel failure"
        finally:
            push.close(linger=0)
            client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("caller", ["task", "handler"])
def test_shutdown_during_a_backlog_stops_the_handler_and_leaves_no_unread_error(caller):
    """shutdown() while the reader works through a backlog (from another task, or from the handler itself):
    no handler call once shutdown() has returned, and no reader future left holding an exception nobody
    reads (asyncio would log "Future exception was never retrieved")."""
    import gc
    import types

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop_errors: list[dict] = []
        loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
        client = EngineCoreClient(types.SimpleNamespace(), num_threads=1)
        push = _inproc_pusher(client)
        calls_at_shutdown: list[int] = []
        count = 0

        def stop() -> None:
            push.close(linger=0)
            client.shutdown()
            calls_at_shutdown.append(count)

        def handler(kind: bytes, obj) -> None:
            nonlocal count
            count += 1
            time.sleep(0.002)
            if caller == "handler" and count == 20:
                stop()

        try:
            for i in range(100):
                push.send_multipart(_outputs("a", i))
            client.start_reader(handler)
            if caller == "task":
                await _wait_for(lambda: count >= 20)
                stop()
            else:
                await _wait_for(lambda: bool(calls_at_shutdown))
            for _ in range(20):  # let drains queued by call_soon run, if any are left
                await asyncio.sleep(0)
            await asyncio.sleep(0.05)
            gc.collect()  # an unread future exception is reported when the future is collected
            assert count == calls_at_shutdown[0] < 100
            assert loop_errors == []
        finally:
            if not push.closed:
                stop()

    asyncio.run(run())


def test_core_killed_without_a_word_is_reported_by_the_reader():
    async def run() -> None:
        client = EngineCoreClient(make_config(), num_threads=1, core_class=FAKE)
        await client.start(timeout_s=120)
        got = Collector()
        client.start_reader(got)
        try:
            client._proc.kill()
            await _wait_for(lambda: got.fatal is not None)
            assert "exited (exit code -9)" in got.fatal and not client.reader_running
        finally:
            client.shutdown()

    asyncio.run(run())
