"""What the server does when its engine-core process dies: fail fast, exit non-zero, let the supervisor restart it.

The core's death is seen by the front end's reader within ~0.5 s (it polls the
process); every request in flight then gets a clean 503 (an error event in a
stream) and `/health` answers 503. `exit_when_engine_dies` then stops the HTTP
server (no new connections; the failed responses drain) so that `run_server`
returns `ENGINE_DEAD_EXIT_CODE`: a supervisor (systemd `Restart=on-failure`,
Kubernetes restarting the container, Docker `--restart`) starts a fresh
process. The server never sits at 503 while still looking alive. This is
vLLM's choice too; restarting the core inside the process would have to
rebuild the engine state the dead core held (KV cache, scheduler queues).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 1
POLL_S = 0.25  # how often the server looks at the engine's health (its reader notices a death within ~0.5 s)


class EngineWatch:
    """Watches `engine` while `server` runs; `engine_died` tells `run_server` which exit code to return."""

    def __init__(self, server: Any, engine: Any) -> None:
        self.server = server
        self.engine = engine
        self.engine_died = False

    async def run(self) -> None:
        """Return once the server is stopping; on an engine death, stop it first (see module docstring)."""
        while not self.server.should_exit:
            try:
                await self.engine.check_health()
            except Exception as exc:  # noqa: BLE001 - any failure is a dead engine (EngineDeadError)
                self.engine_died = True
                logger.error("the engine core died (%s); requests in flight got 503; stopping the server with exit "
                             "code %d so that its supervisor restarts it", exc, ENGINE_DEAD_EXIT_CODE)
                self.server.should_exit = True
                return
            await asyncio.sleep(POLL_S)
