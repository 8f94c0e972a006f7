"""A real `tokenmill serve` process for end-to-end tests (127.0.0.1, a free port, the bundled SmolLM2).

`ServerProcess(tmp, extra_args, env)` starts it; `wait_healthy()` blocks
until /health answers 200; `http(...)` is a tiny http.client client that never
raises on HTTP errors; `stop()` sends SIGINT and kills the group if needed.
`running_server(...)` is the three together, for fixtures. The session's
shared servers are in conftest.py; a module that needs other flags starts
its own through `running_server`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from http import client as http_client
from collections.abc import Iterator
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 420
# A V100 guide's vLLM command line (run here on CPU: --dtype half is float16 on the CPU).
V100_GUIDE_ARGS = ["--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9", "--max-model-len", "2048",
                   "--enforce-eager", "--disable-custom-all-reduce", "--dtype", "half", "--swap-space", "4",
                   "--block-size", "16"]
API_KEY = "tm-test-key-0123456789"
# The session's production server (conftest.py `prod_server`).
PROD_MAX_MODEL_LEN = 256
PROD_MAX_NUM_SEQS = 64
PROD_MAX_BODY_BYTES = 2**20
# The session's agent server (conftest.py `agent_server`): no API key, tool calling on.
AGENT_MAX_MODEL_LEN = 1024
# The session's trusting server (tests/conftest.py `trusting_servers`): no API key, chat templates in requests
# allowed, control tokens typed by users sanitized, metrics also under `vllm:`. Used by e2e/test_hardening.py
# (its last test kills the engine core) and deploy/test_prometheus.py (a burst of 4 x TRUSTING_MAX_NUM_SEQS queues).
TRUSTING_MAX_NUM_SEQS = 16
TRUSTING_ARGS = ["--max-model-len", "512", "--kv-cache-memory-bytes", "512M", "--max-num-seqs",
                 str(TRUSTING_MAX_NUM_SEQS), "--trust-request-chat-template", "--sanitize-control-tokens",
                 "--metrics-vllm-names"]


def no_keepalive(asynchronous: bool = False) -> Any:
    """An httpx client for the `openai` test clients that keeps no idle connection: uvicorn closes a
    connection idle for 5 s (`timeout_keep_alive`), and a client reusing it at that moment gets "Server
    disconnected without sending a response" (seen with two busy test workers). The test clients make no
    retries (`max_retries=0`), so that race would fail a test; real clients retry it."""
    import httpx2
    import openai

    limits = httpx2.Limits(max_connections=1000, max_keepalive_connections=0)
    return (openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient)(limits=limits)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
         timeout: float = 120) -> tuple[int, bytes, dict[str, str]]:
    """One request; `body` is bytes (sent as is) or JSON-able. Returns (status, body, headers).

    A body over PROD_MAX_BODY_BYTES is announced by Content-Length but not sent:
    the server must refuse it (413) from the header alone. Sending it would race
    the server's early answer and close (the client then sees a broken pipe).
    """
    raw = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json"} if raw is not None else {}
    hdrs.update(headers or {})
    parts = urllib.parse.urlsplit(url)
    conn = http_client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.putrequest(method, parts.path + (f"?{parts.query}" if parts.query else ""))
        for name, value in hdrs.items():
            conn.putheader(name, value)
        if raw is not None:
            conn.putheader("Content-Length", str(len(raw)))
        conn.endheaders()
        if raw and len(raw) <= PROD_MAX_BODY_BYTES:
            conn.send(raw)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


SERVE_ENTRY = ("tokenmill.entrypoints.cli", "serve")


class ServerProcess:
    """`python -m tokenmill.entrypoints.cli serve` with `extra_args`, output in tmp/server.log.

    `entry` is the module (and leading arguments) run with `python -m`, e.g.
    ("tokenmill.entrypoints.api_server",) for vLLM's simple /generate server.
    """

    def __init__(self, tmp: Path, extra_args: list[str], env: dict[str, str] | None = None,
                 entry: tuple[str, ...] = SERVE_ENTRY) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        cmd = [sys.executable, "-m", *entry, "--port", str(self.port), "--disable-uvicorn-access-log", *extra_args]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                if http("GET", f"{self.base}/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not healthy after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def engine_core_pids(self) -> list[int]:
        """The server's multiprocessing-spawned children (the engine core), from /proc."""
        pids = []
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    pids.append(int(pid))
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def running_server(tmp: Path, extra_args: list[str], env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A healthy ServerProcess for the `with` block, stopped afterwards (also when start-up fails).

    Raises RuntimeError with the server log's tail if it exits or is not healthy
    within START_TIMEOUT_S.
    """
    srv = ServerProcess(tmp, extra_args, env)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


class RestartingServer:
    """One server with `extra_args` for several test files: `get()` starts it the first time and again after it
    exited (a test may end it on purpose), each in a fresh folder under `tmp_factory`; `stop()` stops it."""

    def __init__(self, tmp_factory: Any, extra_args: list[str], start_timeout_s: float = START_TIMEOUT_S) -> None:
        self._tmp_factory, self._args, self._timeout_s = tmp_factory, extra_args, start_timeout_s
        self._srv: ServerProcess | None = None

    def get(self) -> ServerProcess:
        """The running server (started now if none is running); RuntimeError as `running_server` if it fails."""
        global START_TIMEOUT_S
        if self._srv is not None and self._srv.proc.poll() is None:
            return self._srv
        self.stop()
        self._srv = ServerProcess(self._tmp_factory.mktemp("restarting_server"), self._args)
        default, START_TIMEOUT_S = START_TIMEOUT_S, max(START_TIMEOUT_S, self._timeout_s)
        try:
            self._srv.wait_healthy()
        except BaseException:
            self.stop()
            raise
        finally:
            START_TIMEOUT_S = default
        return self._srv

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.stop()
            self._srv = None
