"""Entry point of one MultiprocExecutor worker process: `python -m tokenmill.executor.mp_worker FD`.

Protocol over the inherited socket FD (a `multiprocessing.connection.Connection`):
first `(engine_config, rank, local_rank, init_method)` in, `("ok", None)` out
once the model is loaded; then `(method, args)` in, `("ok", result)` or
`("error", (exception, traceback text))` out; `("shutdown", ())` ends it.
Only the output rank returns `execute_model` results (the others send None).
The process exits when the engine's end of the socket closes.

With env TOKENMILL_WORKER_STATS=1 each worker prints, at shutdown, its mean
time per step inside `execute_model` and waiting for the engine (to tell
model time from messaging time in a benchmark).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection

from tokenmill import envs


def _reply_error(conn: Connection, exc: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        conn.send(("error", (exc, tb)))
    except Exception:  # noqa: BLE001 - the exception itself may not pickle
        conn.send(("error", (RuntimeError(str(exc)), tb)))


def main(fd: int) -> None:
    conn = Connection(fd)
    engine_config, rank, local_rank, init_method = conn.recv()
    logging.basicConfig(level=envs.logging_level(),
                        format=f"(worker rank={rank}) %(levelname)s %(name)s: %(message)s")
    try:
        from tokenmill.executor.abstract import output_rank
        from tokenmill.worker.worker import Worker

        worker = Worker(engine_config, rank=rank, local_rank=local_rank, distributed_init_method=init_method)
        worker.init_device()
        worker.load_model()
        result_rank = output_rank(engine_config.parallel_config)
    except Exception as exc:  # noqa: BLE001 - reported to the engine, which raises it
        _reply_error(conn, exc)
        return
    conn.send(("ok", None))
    stats = envs.worker_stats()
    steps, busy_s, idle_s = 0, 0.0, 0.0
    while True:
        t0 = time.perf_counter()
        try:
            method, args = conn.recv()
        except EOFError:  # the engine went away
            return
        if method == "shutdown":
            if stats and steps:
                print(f"(worker rank={rank}) {steps} steps: execute_model {busy_s / steps * 1e3:.2f} ms/step, "
                      f"waiting for the engine {idle_s / steps * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
            return
        t1 = time.perf_counter()
        try:
            result = getattr(worker, method)(*args)
        except Exception as exc:  # noqa: BLE001
            _reply_error(conn, exc)
            return
        if method == "execute_model":
            steps, busy_s, idle_s = steps + 1, busy_s + time.perf_counter() - t1, idle_s + t1 - t0
        if method == "execute_model" and rank != result_rank:
            result = None  # only the output rank's result is used; skip pickling the rest
        conn.send(("ok", result))


if __name__ == "__main__":
    main(int(sys.argv[1]))
    # Skip interpreter teardown (process-group and thread-pool destructors take
    # seconds); nothing is left to flush but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
