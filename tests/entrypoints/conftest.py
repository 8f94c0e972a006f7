"""Fixtures for the HTTP-layer tests: a fake engine, the app over it, and a sync request helper."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fake_engine import FakeEngine, asgi_call


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(fake_engine: FakeEngine) -> Any:
    from tokenmill.entrypoints.openai.api_server import build_app

    return build_app(fake_engine, ["fake-model"], max_logprobs=5)


@pytest.fixture
def call(app: Any):
    def _call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
        status, raw = asyncio.run(asgi_call(app, method, path, body))
        return status, raw

    return _call
