"""EngineWatch: a dead engine stops the server (and picks the exit code); a stopping server ends the watch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tokenmill.frontend.core_client import EngineDeadError, ServerShuttingDownError
from tokenmill.entrypoints.openai import engine_watch
from tokenmill.entrypoints.openai.engine_watch import EngineWatch


class Engine:
    def __init__(self, healthy_checks: int) -> None:
        self.left = healthy_checks
        self.checks = 0

    async def check_health(self) -> None:
        self.checks += 1
        if self.checks > self.left:
            raise EngineDeadError("The engine core process exited (exit code -9).")


@pytest.fixture(autouse=True)
def no_poll_delay(monkeypatch):
    monkeypatch.setattr(engine_watch, "POLL_S", 0)


def test_a_dead_engine_stops_the_server():
    server = SimpleNamespace(should_exit=False)
    watch = EngineWatch(server, Engine(healthy_checks=3))
    asyncio.run(watch.run())
    assert server.should_exit and watch.engine_died and watch.engine.checks == 4


def test_a_stopping_server_ends_the_watch_without_blaming_the_engine():
    server = SimpleNamespace(should_exit=True)
    watch = EngineWatch(server, Engine(healthy_checks=0))
    asyncio.run(watch.run())
    assert not watch.engine_died and watch.engine.checks == 0


def test_error_messages_say_what_happened():
    assert EngineDeadError("gone").user_message() == "The engine is not running: gone"
    assert ServerShuttingDownError("The server is shutting down.").user_message() == "The server is shutting down."

