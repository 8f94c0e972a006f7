"""MultiprocExecutor: one worker process per rank on this host (tensor / pipeline parallel).

    engine process                          worker processes (rank 0 .. W-1)
    ──────────────                          ───────────────────────────────
    pickle(("execute_model", (so,)))  ──►   Worker.execute_model(so)   every rank runs
    one socketpair per worker               its shard; ranks talk to each other only
    result of the output rank  ◄────────   through torch.distributed (NCCL / gloo)

Workers are fresh interpreters (`python -m tokenmill.executor.mp_worker`), not
`multiprocessing` children, so a user script without an
`if __name__ == "__main__":` guard is not re-imported, and nothing beyond the
standard library and torch is needed (no zmq, msgspec or ray). Each step's
SchedulerOutput is pickled once and the same bytes go to every worker.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from tokenmill import envs
from tokenmill.config.configs import EngineConfig
from tokenmill.distributed.init import get_open_port, set_nccl_env_defaults
from tokenmill.executor.abstract import DistributedExecutor

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 1800.0  # loading a large checkpoint can take long
_SHUTDOWN_GRACE_S = 5.0


def check_cuda_device_count(world_size: int) -> None:
    """Raise when this host has fewer visible CUDA devices than ranks.

    Raises:
        ValueError: naming the counts and what to do.
    """
    import torch

    count = torch.cuda.device_count()
    if world_size > count:
        raise ValueError(
            f"tensor_parallel_size x pipeline_parallel_size = {world_size} ranks need {world_size} GPUs, but this "
            f"host has {count} visible (CUDA_VISIBLE_DEVICES={envs.cuda_visible_devices() or 'unset'}); "
            "lower the sizes, or use --distributed-executor-backend ray on a multi-host Ray cluster."
        )


class MultiprocExecutor(DistributedExecutor):
    """Starts `world_size` worker processes, one per GPU (CUDA) or per rank (CPU).

    Raises:
        ValueError: more ranks than GPUs, or a worker's start-up ValueError
            (e.g. sizes that do not split the model), re-raised with its message.
        RuntimeError: a worker died or failed.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        pc = engine_config.parallel_config
        on_cuda = engine_config.device_config.device == "cuda"
        if on_cuda:
            check_cuda_device_count(self.world_size)
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, _kill_all, self.procs)
        env = os.environ.copy()
        if on_cuda:
            set_nccl_env_defaults(env)
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        try:
            for rank in range(self.world_size):
                parent_sock, child_sock = socket.socketpair()
                fd = child_sock.fileno()
                proc = subprocess.Popen([sys.executable, "-m", "tokenmill.executor.mp_worker", str(fd)],
                                        env=env, pass_fds=(fd,), stdin=subprocess.DEVNULL)
                child_sock.close()
                self.procs.append(proc)
                self.conns.append(Connection(parent_sock.detach()))
            for rank, conn in enumerate(self.conns):
                conn.send((engine_config, rank, rank, init_method))
            self._collect(timeout_s=_STARTUP_TIMEOUT_S)  # init_device + load_model
        except BaseException:
            self.shutdown()
            raise
        logger.info("Started %d worker processes (tp=%d, pp=%d)", self.world_size, pc.tensor_parallel_size,
                    pc.pipeline_parallel_size)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Send the call, pickled once, to every worker and wait for all replies (`_collect`)."""
        if not self.conns:
            raise RuntimeError("The executor was shut down.")
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)
        return self._collect(timeout_s=None)

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown", ()))
            except OSError:
                pass
        deadline = time.monotonic() + _SHUTDOWN_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        _kill_all(self.procs)
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self.procs.clear()

    # ---- messaging ----------------------------------------------------------------

    def _collect(self, timeout_s: float | None) -> list[Any]:
        """One reply per worker, polled together so a failing rank is reported at once.

        A rank that fails while the others wait in a collective would hang
        them; the first error therefore ends the whole group.
        """
        results: list[Any] = [None] * len(self.conns)
        pending = {self.conns[rank]: rank for rank in range(len(self.conns))}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            ready = wait(list(pending), timeout=1.0)
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    self._fail(f"Worker rank {rank} exited (code {self.procs[rank].wait()}); see its log above.")
                if status == "error":
                    exc, tb = payload
                    self.shutdown()
                    if isinstance(exc, ValueError):
                        raise ValueError(str(exc)) from None
                    raise RuntimeError(f"Worker rank {rank} failed:\n{tb}")
                results[rank] = payload
            if not ready:
                for rank in pending.values():
                    if self.procs[rank].poll() is not None:
                        self._fail(f"Worker rank {rank} died with exit code {self.procs[rank].returncode} "
                                   "(out of memory? see its log above).")
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(f"Worker ranks {sorted(pending.values())} did not start within {timeout_s:.0f} s.")
        return results

    def _fail(self, message: str) -> None:
        self.shutdown()
        raise RuntimeError(message)


def _kill_all(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
