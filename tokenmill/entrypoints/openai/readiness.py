"""`GET /ready`: the readiness (and startup) probe route.

`/health` is liveness: 200 while the engine core process runs. `/ready` says
more: 200 only once the engine has answered a real request (a one-token
greedy generation of a one-token prompt, done once, on the first probe),
and from then on while `/health` would pass. Before that it is 503 with an
OpenAI-style error body. The HTTP port only opens after the model is
loaded, so a probe before that sees a refused connection, which Kubernetes
also counts as not ready; while the server drains on SIGTERM the listener is
closed, so the pod leaves its Service at once.

The warm-up request is counted in `/metrics` like any other request.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from tokenmill.entrypoints.openai.errors import error_response
from tokenmill.sampling_params import SamplingParams

# Long enough for the first step on a slow CPU (a kernel build, a compile); a probe that waits longer
# than its own timeoutSeconds simply fails and is retried.
PROBE_TIMEOUT_S = 120.0


class Readiness:
    """Whether `engine` has answered once and still runs.

    Args:
        engine: an `AsyncLLM` (or a test fake with `check_health()` and,
            optionally, `generate(prompt, sampling_params, request_id)`;
            without `generate` the engine counts as answered).
        timeout_s: how long the warm-up generation may take.
    """

    def __init__(self, engine: Any, timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self._engine = engine
        self._timeout_s = timeout_s
        self._answered = not hasattr(engine, "generate")
        self._lock = asyncio.Lock()

    async def check(self) -> str | None:
        """None when ready, else a sentence saying why not."""
        try:
            await self._engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            return f"The engine is not running: {exc}"
        if self._answered:
            return None
        async with self._lock:  # one warm-up request, however many probes arrive at once
            if not self._answered:
                try:
                    await asyncio.wait_for(self._generate_one_token(), self._timeout_s)
                except Exception as exc:  # noqa: BLE001 - timeout, dead engine, ...
                    return f"The engine has not answered a test request yet: {exc!r}"
                self._answered = True
        return None

    async def _generate_one_token(self) -> None:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in self._engine.generate([0], params, request_id=f"ready-{uuid.uuid4().hex}"):
            pass


def readiness_route(engine: Any) -> Callable[..., Any]:
    """The GET /ready handler for `engine` (200 {"status": "ready"} or 503)."""
    readiness = Readiness(engine)

    async def ready() -> Any:
        reason = await readiness.check()
        if reason is not None:
            return error_response(reason, 503)
        return JSONResponse({"status": "ready"})

    return ready
