"""/ready (readiness.py) and the HTTP status counter (response_counter.py) over fake engines."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tokenmill.entrypoints.openai.api_server import build_app
from tokenmill.entrypoints.openai.readiness import Readiness


class _Engine:
    """Enough of AsyncLLM for build_app and /ready: health, a one-token generate, a tokenizer stub."""

    def __init__(self, healthy: bool = True, generate_hangs: bool = False) -> None:
        self.healthy = healthy
        self.generate_hangs = generate_hangs
        self.generated: list[tuple[list[int], int | None]] = []
        self.max_model_len = 64
        self.tokenizer = None

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("core process exited")

    def get_scheduler_stats(self) -> None:
        return None

    async def generate(self, prompt: list[int], params: Any, request_id: str):
        self.generated.append((prompt, params.max_tokens))
        if self.generate_hangs:
            await asyncio.Event().wait()
        yield object()


def _get(app: Any, *paths: str, headers: dict[str, str] | None = None) -> list[httpx.Response]:
    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.get(p, headers=headers) for p in paths]

    return asyncio.run(run())


def test_ready_generates_one_token_once_then_only_checks_health():
    engine = _Engine()
    app = build_app(engine, ["m"])
    first, second, third = _get(app, "/ready", "/ready", "/ready")
    assert [r.status_code for r in (first, second, third)] == [200, 200, 200]
    assert first.json() == {"status": "ready"}
    assert engine.generated == [([0], 1)]
    engine.healthy = False
    (dead,) = _get(app, "/ready")
    assert dead.status_code == 503
    assert "core process exited" in dead.json()["error"]["message"]


def test_ready_is_503_until_the_engine_answers():
    engine = _Engine(generate_hangs=True)
    readiness = Readiness(engine, timeout_s=0.05)
    reason = asyncio.run(readiness.check())
    assert reason is not None and "has not answered" in reason
    engine.generate_hangs = False
    assert asyncio.run(readiness.check()) is None
    assert len(engine.generated) == 2


def test_ready_is_not_behind_the_api_key():
    app = build_app(_Engine(), ["m"], api_keys=["k" * 20])
    ready, models = _get(app, "/ready", "/v1/models")
    assert (ready.status_code, models.status_code) == (200, 401)


def test_http_responses_are_counted_by_status_under_both_prefixes():
    app = build_app(_Engine(healthy=False), ["m"], api_keys=["k" * 20], metrics_vllm_names=True)
    _get(app, "/health", "/v1/models", "/v1/models")
    _get(app, "/no-such-route", headers={"Authorization": "Bearer " + "k" * 20})
    (metrics,) = _get(app, "/metrics")
    text = metrics.text
    for prefix in ("tokenmill:", "vllm:"):
        assert f'{prefix}http_responses_total{{model_name="m",status="503"}} 1.0' in text
        assert f'{prefix}http_responses_total{{model_name="m",status="401"}} 2.0' in text
        assert f'{prefix}http_responses_total{{model_name="m",status="404"}} 1.0' in text
    # /metrics itself is counted once its response has started, so the first scrape does not see itself;
    # the statuses the server sends exist from the start at 0, so rate() sees their first response.
    assert 'tokenmill:http_responses_total{model_name="m",status="200"} 0.0' in text
    assert 'vllm:http_responses_total{model_name="m",status="500"} 0.0' in text
    (again,) = _get(app, "/metrics")
    assert 'tokenmill:http_responses_total{model_name="m",status="200"} 1.0' in again.text
