"""The engine core in its own process: a busy loop behind two zmq sockets.

    front end (AsyncLLM)                      core process (this module)
    PUSH  --- ADD / ABORT / SHUTDOWN --->     PULL   input_addr
    PULL  <--- READY / OUTPUTS / errors ---   PUSH   output_addr

The front end binds both sockets (ipc:// paths in a private temp dir) and
spawns this process, which connects. Start-up: build `EngineCore` (load the
model, size the KV cache); send READY with a few facts, or STARTUP_ERROR with
the `ValueError` text (the front end prints it and exits non-zero).

Loop invariant: while the scheduler has unfinished requests the loop never
blocks (it drains the input socket without waiting, then runs one `step()`);
when idle it blocks on the input socket for up to `_IDLE_POLL_MS` and checks
that the front end is still alive, so an orphaned core exits by itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import zmq

from tokenmill import envs
from tokenmill.core.request import RequestStatus
from tokenmill.engine.messages import (
    EngineCoreOutputs,
    MessageKind,
    decode_obj,
    decode_request,
    encode_obj,
    encode_outputs,
)

if TYPE_CHECKING:
    from tokenmill.config.configs import EngineConfig

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000  # how long an idle core waits for input before checking its parent
_PARENT_CHECK_STEPS = 256  # busy steps between parent-alive checks


# From this many CPUs on, one CPU is left to the front end (API server, tokenizer, detokenizer).
RESERVE_FRONT_END_CPU_FROM = 8


def core_num_threads(num_cpus: int | None = None, device: str = "cpu") -> int:
    """Torch intra-op threads for the core process.

    CPU inference with fewer than `RESERVE_FRONT_END_CPU_FROM` CPUs: all of
    them (the front end needs a fraction of a core, so a reserved core mostly
    idles); otherwise all but one, which the front end keeps (as vLLM's CPU
    build does). Measured on the 2-core box (SmolLM2-135M, `tokenmill bench
    serve`, 128 prompts of 128 tokens, 64 output tokens, concurrency 64,
    same hour): bfloat16 191 -> 260 output tok/s and float32 ~95 -> 135 going
    from 1 to 2 threads; 16 concurrent JSON-schema chat requests with 16
    distinct schemas (each grammar compiles on a thread of the core process),
    float32: 5.3 -> 4.4 s. Not measured: long prompts.
    TOKENMILL_CPU_THREADS sets the count when the default does not suit.

    Args:
        num_cpus: CPUs available (default: this process's affinity set).
        device: the engine's device ("cpu", "cuda"); on a GPU the core's
            threads only do host work, and one CPU stays with the front end.

    Env:
        TOKENMILL_CPU_THREADS: overrides the count (the worker honours it too).
    """
    if num_cpus is None:
        num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    override = envs.cpu_threads()
    if override:
        return max(1, override)
    if device == "cpu" and num_cpus < RESERVE_FRONT_END_CPU_FROM:
        return num_cpus
    return max(1, num_cpus - 1)


def run_engine_core(engine_config: EngineConfig, input_addr: str, output_addr: str, num_threads: int,
                    core_class: str = "tokenmill.engine.core:EngineCore") -> None:
    """Process entry point (spawned): build the core, handshake, serve until told to stop.

    Exit code: 0 after SHUTDOWN or when the front end is gone; 1 after
    STARTUP_ERROR or FATAL (a supervisor or `ps` sees the failure).

    Args:
        engine_config: the resolved `EngineConfig` (pickled across the spawn).
        input_addr / output_addr: zmq endpoints the front end bound.
        num_threads: torch intra-op threads for this process.
        core_class: "module:Class" of the core (tests substitute a fake).
    """
    # Ctrl-C goes to the whole process group; the front end decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [core] %(message)s")
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    for sock in (in_sock, out_sock):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    core = None
    exit_code = 1  # 0 only for a clean stop: SHUTDOWN, or the front end gone
    try:
        core = _build_core(engine_config, num_threads, out_sock, core_class)
        if core is None:
            return  # STARTUP_ERROR sent
        _busy_loop(core, in_sock, out_sock)
        exit_code = 0
    except Exception:  # noqa: BLE001 - anything here kills the engine; tell the front end why
        text = traceback.format_exc()
        logger.error("engine core died:\n%s", text)
        out_sock.send_multipart([MessageKind.FATAL, encode_obj(text)])
    finally:
        shutdown = getattr(core, "shutdown", None)
        if shutdown is not None:
            shutdown()
        in_sock.close(linger=0)
        out_sock.close()
        ctx.term()
        logger.info("engine core stopped")
        logging.shutdown()
        # Library threads and atexit hooks (torch, loaders) can hold a normal
        # interpreter exit for seconds; nothing is left to clean up here.
        os._exit(exit_code)


def set_omp_wait_default(environ: MutableMapping[str, str]) -> None:
    """Set GOMP_SPINCOUNT=`envs.DEFAULT_GOMP_SPINCOUNT` in `environ` unless the user set it or OMP_WAIT_POLICY.

    Threads waiting between parallel regions spin 30k rounds, then sleep. libgomp's default
    (~300k rounds) holds the core a descheduled teammate needs when another process shares the
    CPUs (docs/benchmarks.md, "CPU threads under a CPU hog"); sleeping at once (PASSIVE) pays a
    futex wake per region: served at concurrency 1, SmolLM2 Q4_1 decoded at 29 tok/s instead of
    52 ("Concurrency 1 beside llama.cpp's server"). Under a hog the worker drops to 1 thread
    (`worker/cpu_threads.py`), where no thread waits. Must run before torch (libgomp) loads.
    """
    if envs.omp_wait_policy(environ) is None and envs.gomp_spincount(environ) is None:
        environ["GOMP_SPINCOUNT"] = str(envs.DEFAULT_GOMP_SPINCOUNT)


def _build_core(engine_config: EngineConfig, num_threads: int, out_sock: zmq.Socket, core_class: str) -> Any | None:
    """Create the core; on failure send STARTUP_ERROR and return None."""
    try:
        import importlib

        # Before torch loads (the core's import does it): its thread pools
        # read this; set_num_threads below covers a torch already loaded.
        os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
        set_omp_wait_default(os.environ)
        module_name, class_name = core_class.split(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(num_threads)
        core = cls(engine_config)
        from tokenmill.engine.gc_heap import freeze_gc_heap

        freeze_gc_heap()  # start-up objects out of the step loop's GC passes
    except Exception as exc:  # noqa: BLE001 - reported to the front end, which exits
        if isinstance(exc, ValueError):
            text = str(exc)
        else:
            text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        out_sock.send_multipart([MessageKind.STARTUP_ERROR, encode_obj(text)])
        return None
    cache = engine_config.cache_config
    info = {
        "pid": os.getpid(),
        "num_gpu_blocks": int(getattr(cache, "num_gpu_blocks", 0) or 0),
        "block_size": int(cache.block_size),
        "max_model_len": int(engine_config.model_config.max_model_len),
        "num_threads": num_threads,
    }
    out_sock.send_multipart([MessageKind.READY, encode_obj(info)])
    return core


def _has_work(core: Any) -> bool:
    fn = getattr(core, "has_unfinished_requests", None)
    if fn is None:
        fn = core.scheduler.has_unfinished_requests
    return bool(fn())


def _busy_loop(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(in_sock, zmq.POLLIN)
    parent = multiprocessing.parent_process()
    steps_since_check = 0
    last_stats = None
    while True:
        # Idle: block for input, waking now and then to check the front end.
        if not _has_work(core) and not poller.poll(_IDLE_POLL_MS):
            if parent is not None and not parent.is_alive():
                logger.info("front end is gone; engine core exits")
                return
            continue
        keep_going, aborted = _drain_input(core, in_sock, out_sock)
        if not keep_going:
            return
        if not _has_work(core):
            if aborted:
                # No step will follow to report it: send the freed state now,
                # so /stats shows the aborted requests gone.
                last_stats = core.get_stats()
                out_sock.send_multipart([MessageKind.OUTPUTS,
                                         encode_outputs(EngineCoreOutputs(scheduler_stats=last_stats))])
            continue
        outputs = core.step()
        # A step that scheduled nothing (all waiting for blocks) changes
        # nothing worth sending; skip it so a stalled loop does not flood.
        if outputs.outputs or outputs.scheduler_stats != last_stats:
            last_stats = outputs.scheduler_stats
            out_sock.send_multipart([MessageKind.OUTPUTS, encode_outputs(outputs)], copy=False)
        steps_since_check += 1
        if steps_since_check >= _PARENT_CHECK_STEPS:
            steps_since_check = 0
            if parent is not None and not parent.is_alive():
                return


def _drain_input(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket) -> tuple[bool, bool]:
    """Apply every pending message without blocking.

    Returns:
        (keep_going, aborted): keep_going is False on SHUTDOWN; aborted is
        True when an ABORT was applied.
    """
    aborted = False
    while True:
        try:
            kind, payload = in_sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return True, aborted
        if kind == MessageKind.ADD:
            request = decode_request(payload)
            try:
                core.add_request(request)
            except ValueError as exc:
                # A request the core refuses is the client's mistake: fail that
                # request (HTTP 400), keep serving the rest.
                out_sock.send_multipart([MessageKind.REQUEST_ERROR, encode_obj([request.request_id, str(exc)])])
        elif kind == MessageKind.ABORT:
            request_ids, status = decode_obj(payload)
            core.abort_requests(request_ids, RequestStatus(status))
            aborted = True
        elif kind == MessageKind.SHUTDOWN:
            return False, aborted
        else:
            logger.warning("engine core ignores unknown message kind %r", kind)
