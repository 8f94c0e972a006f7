"""Fast checks of the production layers over a fake engine: auth, body guard, X-Request-Id, metrics arithmetic."""

from __future__ import annotations

import asyncio
import json
import signal
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine, _scope

from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenmill.entrypoints.openai.auth import APIKeyMiddleware, resolve_api_keys
from tokenmill.entrypoints.openai.metrics import ServerMetrics
from tokenmill.outputs import RequestMetrics


async def _raw_call(app, method: str, path: str, body: bytes = b"", headers: list | None = None,
                    chunks: list[bytes] | None = None) -> tuple[int, dict, bytes]:
    scope = _scope(method, path)
    if headers is not None:
        scope["headers"] = [(b"host", b"test"), *headers]
    parts = chunks if chunks is not None else [body]
    sent: list[dict] = []
    queue = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    hdrs = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], hdrs, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.fixture
def guarded_app():
    from tokenmill.entrypoints.openai.api_server import build_app

    return build_app(FakeEngine(), ["fake-model"], api_keys=["k1", "k2"], max_request_body_bytes=100)


JSON = (b"content-type", b"application/json")


def test_keys_are_required_except_on_open_routes(guarded_app):
    body = json.dumps({"prompt": "ab", "max_tokens": 1}).encode()
    for auth in ([], [(b"authorization", b"Bearer nope")], [(b"authorization", b"k1")]):
        status, hdrs, raw = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", body, [JSON, *auth]))
        assert status == 401 and hdrs["www-authenticate"] == "Bearer"
        assert json.loads(raw)["error"]["code"] == "invalid_api_key"
    for key in (b"k1", b"k2"):
        status, _, _ = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", body,
                                             [JSON, (b"authorization", b"Bearer " + key)]))
        assert status == 200
    for path in ("/health", "/metrics", "/version", "/api/version"):
        assert asyncio.run(_raw_call(guarded_app, "GET", path, headers=[]))[0] == 200
    status, _, raw = asyncio.run(_raw_call(guarded_app, "GET", "/api/tags", headers=[]))
    assert status == 401 and isinstance(json.loads(raw)["error"], str)  # Ollama's error shape


def test_key_check_looks_at_every_key():
    mw = APIKeyMiddleware(app=None, api_keys=["a" * 32, "b" * 32])
    assert mw.is_authorized(b"b" * 32) and not mw.is_authorized(b"b" * 31) and not mw.is_authorized(None)


def test_api_key_sources():
    assert resolve_api_keys(["x"], {"TOKENMILL_API_KEY": "y"}) == ["x"]
    assert resolve_api_keys(None, {"TOKENMILL_API_KEY": "y", "VLLM_API_KEY": "z"}) == ["y"]
    assert resolve_api_keys(None, {"VLLM_API_KEY": "z"}) == ["z"]
    assert resolve_api_keys(None, {}) == []
    with pytest.raises(ValueError, match="empty"):
        resolve_api_keys([" "], {})


def test_body_guard_size_content_type_and_chunked_bodies(guarded_app):
    auth = (b"authorization", b"Bearer k1")
    big = json.dumps({"prompt": "x" * 200}).encode()
    status, _, raw = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", big,
                                           [JSON, auth, (b"content-length", str(len(big)).encode())]))
    assert status == 413 and "max-request-body-bytes" in json.loads(raw)["error"]["message"]
    # No Content-Length: the guard counts the chunks as they arrive.
    status, _, _ = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", headers=[JSON, auth],
                                         chunks=[big[:60], big[60:]]))
    assert status == 413
    small = json.dumps({"prompt": "ab", "max_tokens": 1}).encode()
    status, _, _ = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", headers=[JSON, auth],
                                         chunks=[small[:5], small[5:]]))
    assert status == 200
    status, _, _ = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", small,
                                         [(b"content-type", b"text/plain"), auth]))
    assert status == 415
    # Ollama's documented `curl -d` sends a form content type; its routes accept it.
    status, _, _ = asyncio.run(_raw_call(guarded_app, "POST", "/api/show", b"{}",
                                         [(b"content-type", b"application/x-www-form-urlencoded"), auth]))
    assert status == 200


def test_request_id_header_is_echoed_or_made(guarded_app):
    auth = (b"authorization", b"Bearer k1")
    body = json.dumps({"prompt": "ab", "max_tokens": 1}).encode()
    status, hdrs, raw = asyncio.run(_raw_call(guarded_app, "POST", "/v1/completions", body,
                                              [JSON, auth, (b"x-request-id", b"abc-1")]))
    assert status == 200 and hdrs["x-request-id"] == "abc-1" and json.loads(raw)["id"] == "cmpl-abc-1"
    _, hdrs, _ = asyncio.run(_raw_call(guarded_app, "GET", "/health", headers=[(b"x-request-id", b"bad id")]))
    assert hdrs["x-request-id"] != "bad id" and len(hdrs["x-request-id"]) == 32


def _state(arrival: float, prompt_len: int):
    return SimpleNamespace(metrics=RequestMetrics(arrival_time=arrival), prompt_token_ids=[0] * prompt_len,
                           finish_reason=None)


def _value(m: ServerMetrics, name: str, **labels: str) -> float:
    return m.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_metrics_turn_cumulative_stats_into_increments_and_time_requests():
    m = ServerMetrics("m", vllm_names=True)
    m.observe_scheduler_stats(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.5, num_preemptions=3,
                                             prefix_cache_queries=100, prefix_cache_hits=40))
    m.observe_scheduler_stats(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25, num_preemptions=5,
                                             prefix_cache_queries=150, prefix_cache_hits=40))
    assert _value(m, "tokenmill:num_preemptions_total") == 5 == _value(m, "vllm:num_preemptions_total")
    assert _value(m, "tokenmill:prefix_cache_queries_total") == 150
    assert _value(m, "tokenmill:num_requests_running") == 1 and _value(m, "vllm:kv_cache_usage_perc") == 0.25
    # A restarted core's counters start again from 0: counted from there, never negative.
    m.observe_scheduler_stats(SchedulerStats(num_preemptions=2))
    assert _value(m, "tokenmill:num_preemptions_total") == 7

    states = {"r": _state(100.0, 7)}
    first = EngineCoreOutputs([EngineCoreOutput("r", [1], scheduled_time=100.5)], timestamp=101.0)
    seen = m.observe_core_outputs(first, states)
    states["r"].metrics.first_token_time = states["r"].metrics.last_token_time = 101.0
    m.observe_processed(seen)
    second = EngineCoreOutputs([EngineCoreOutput("r", [2, 3])], timestamp=101.5)
    seen = m.observe_core_outputs(second, states)
    states["r"].finish_reason, states["r"].metrics.finished_time = "length", 101.5
    m.observe_processed(seen)
    assert _value(m, "tokenmill:prompt_tokens_total") == 7 and _value(m, "tokenmill:generation_tokens_total") == 3
    assert _value(m, "tokenmill:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "tokenmill:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "tokenmill:inter_token_latency_seconds_count") == 1
    assert _value(m, "tokenmill:inter_token_latency_seconds_sum") == pytest.approx(0.25)  # 0.5 s over 2 tokens
    assert _value(m, "tokenmill:request_success_total", finished_reason="length") == 1
    assert _value(m, "tokenmill:e2e_request_latency_seconds_sum") == pytest.approx(1.5)
    m.observe_aborted([_state(0.0, 1)])
    assert _value(m, "vllm:request_success_total", finished_reason="abort") == 1


def test_cache_config_info_shows_the_kv_cache_dtype():
    from tokenmill.config.configs import CacheConfig
    from tokenmill.entrypoints.openai.metrics import cache_config_info

    m = ServerMetrics("m", vllm_names=True, cache_info=cache_config_info(CacheConfig(block_size=32, cache_dtype="fp8")))
    labels = {"block_size": "32", "cache_dtype": "fp8", "enable_prefix_caching": "True",
              "gpu_memory_utilization": "0.9"}
    assert _value(m, "tokenmill:cache_config_info", **labels) == 1 == _value(m, "vllm:cache_config_info", **labels)
    assert b"cache_config_info" not in ServerMetrics("m").render()


class _GraceEngine:
    """Counts in-flight requests and records abort_all's reason (for `_abort_after_grace`)."""

    def __init__(self, in_flight: int) -> None:
        self.num_requests_in_flight = in_flight
        self.reasons: list[str] = []

    def abort_all(self, reason: str) -> int:
        self.reasons.append(reason)
        left, self.num_requests_in_flight = self.num_requests_in_flight, 0
        return left


def test_grace_runs_out_or_a_second_signal_ends_it_and_what_is_left_is_aborted():
    from tokenmill.entrypoints.openai.api_server import _abort_after_grace, _graceful_server

    # The grace period runs out (0 s here) with a request still in flight: it is aborted, saying why.
    engine = _GraceEngine(in_flight=1)
    asyncio.run(_abort_after_grace(SimpleNamespace(should_exit=True), engine, 0))
    assert engine.reasons == ["The server is shutting down; the request was aborted after the 0 s grace period "
                              "(--shutdown-timeout)."]
    # A second stop signal ends a long grace period at once.
    import uvicorn

    server = _graceful_server(uvicorn.Config(app=None))
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.grace_cut_short
    server.handle_exit(signal.SIGTERM, None)
    assert server.grace_cut_short
    engine = _GraceEngine(in_flight=2)
    asyncio.run(asyncio.wait_for(_abort_after_grace(server, engine, 3600), timeout=600))
    assert engine.reasons == ["The server is shutting down; the request was aborted: a second stop signal ended "
                              "the grace period (--shutdown-timeout)."]


def test_second_sigint_ends_the_grace_without_uvicorns_force_exit():
    """uvicorn turns a second SIGINT into force_exit, which stops waiting for connections: serve() would return
    before the streams aborted by the cut-short grace have written their error event and [DONE]. The second
    SIGINT only ends the grace; a third one is uvicorn's force quit."""
    import uvicorn

    from tokenmill.entrypoints.openai.api_server import _graceful_server

    server = _graceful_server(uvicorn.Config(app=None))
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.grace_cut_short and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.grace_cut_short and not server.force_exit
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit
