"""vLLM's HTTP surface over a fake engine: 501 routes, CORS, --middleware, docs, the legacy /generate API,
start-up checks, the stats line, the "serving on" line, and --max-seq-len-to-capture's gate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from types import SimpleNamespace

import pytest
from fake_engine import FakeEngine, asgi_call, fake_completion_text
from fastapi.testclient import TestClient

from tokenmill.entrypoints.api_server import build_generate_app
from tokenmill.entrypoints.cli import main
from tokenmill.entrypoints.openai.api_server import _log_when_bound, build_app
from tokenmill.entrypoints.openai.http_options import CORSOptions, HTTPOptions, check_before_start
from tokenmill.entrypoints.openai.stats_logger import stats_line
from tokenmill.entrypoints.openai.unbuilt_routes import UNBUILT_ROUTES
from tokenmill.core.outputs import SchedulerStats


@pytest.mark.parametrize("path", sorted(UNBUILT_ROUTES))
def test_unbuilt_vllm_routes_answer_501_with_an_openai_error(app, path):
    status, raw = asyncio.run(asgi_call(app, "POST", path, {"input": "x", "model": "fake-model"}))
    assert status == 501
    error = json.loads(raw)["error"]
    assert error["type"] == "not_implemented_error" and error["code"] == 501
    assert "not supported by tokenmill yet" in error["message"] and path in error["message"]


def test_cors_only_when_asked():
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    plain = TestClient(build_app(FakeEngine(), ["m"], max_logprobs=5))
    assert "access-control-allow-origin" not in plain.options("/v1/completions", headers=preflight).headers
    opts = HTTPOptions(cors=CORSOptions(["http://example.com"], ["*"], ["*"], False))
    client = TestClient(build_app(FakeEngine(), ["m"], max_logprobs=5, api_keys=["k"], http_options=opts))
    response = client.options("/v1/completions", headers=preflight)
    assert response.status_code == 200  # a preflight never needs the API key
    assert response.headers["access-control-allow-origin"] == "http://example.com"
    assert "access-control-allow-origin" not in client.options(
        "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}).headers


def test_middleware_class_and_function_and_disabled_docs(tmp_path, monkeypatch):
    (tmp_path / "tm_test_mw.py").write_text(
        "async def tag(request, call_next):\n"
        "    response = await call_next(request)\n"
        "    response.headers['x-tagged'] = 'yes'\n"
        "    return response\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    opts = HTTPOptions(middleware=["tm_test_mw.tag", "starlette.middleware.gzip.GZipMiddleware"], docs=False)
    client = TestClient(build_app(FakeEngine(), ["m"], max_logprobs=5, http_options=opts))
    response = client.get("/health")
    assert response.headers["x-tagged"] == "yes"
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    big = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 60, "n": 3},
                      headers={"Accept-Encoding": "gzip"})
    assert big.status_code == 200 and big.headers["content-encoding"] == "gzip"
    assert TestClient(build_app(FakeEngine(), ["m"], max_logprobs=5)).get("/docs").status_code == 200
    with pytest.raises(ValueError, match="--middleware no_such_module.thing cannot be imported"):
        build_app(FakeEngine(), ["m"], max_logprobs=5, http_options=HTTPOptions(middleware=["no_such_module.thing"]))


@pytest.fixture
def legacy():
    args = argparse.Namespace(api_key=None)
    return TestClient(build_generate_app(FakeEngine(), ["m"], args, HTTPOptions()))


def test_generate_answers_prompt_plus_completion(legacy):
    # vLLM's documented call: curl -d '{...}' (a form content type); the body is read as JSON anyway.
    response = legacy.post("/generate", content=json.dumps({"prompt": "Hi", "max_tokens": 3, "n": 2}),
                           headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200
    assert response.json() == {"text": ["Hi" + fake_completion_text(3)] * 2}
    assert legacy.get("/health").status_code == 200


def test_generate_streams_nul_separated_cumulative_json(legacy):
    response = legacy.post("/generate", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert response.status_code == 200
    raw = response.content
    assert raw.endswith(b"\0")
    chunks = [json.loads(c) for c in raw.split(b"\0")[:-1]]
    assert chunks == [{"text": ["Hi" + fake_completion_text(k)]} for k in (1, 2, 3)]


@pytest.mark.parametrize("body, words", [
    ({"max_tokens": 3}, "'prompt' is required"),
    ({"prompt": "Hi", "bogus": 1}, "Unknown /generate field"),
    ({"prompt": "Hi", "stream": "yes"}, "'stream' must be true or false"),
    ({"prompt": "Hi", "max_tokens": 500}, "maximum context length"),
])
def test_generate_bad_input_is_400_with_a_sentence(legacy, body, words):
    response = legacy.post("/generate", json=body)
    assert response.status_code == 400 and words in response.json()["error"]["message"]


def test_generate_api_key_applies():
    args = argparse.Namespace(api_key=["k"])
    client = TestClient(build_generate_app(FakeEngine(), ["m"], args, HTTPOptions()))
    assert client.post("/generate", json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
    assert client.post("/generate", json={"prompt": "Hi", "max_tokens": 1},
                       headers={"Authorization": "Bearer k"}).status_code == 200
    assert client.get("/health").status_code == 200


def _args(**kw):
    base = dict(port=8000, ssl_keyfile=None, ssl_certfile=None, ssl_ca_certs=None, chat_template=None, model=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, words", [
    ({"port": 70000}, "--port must be between 0 and 65535"),
    ({"port": -1}, "--port must be between 0 and 65535"),
    ({"chat_template": "/nonexistent/template.jinja"}, "--chat-template /nonexistent/template.jinja: no such file"),
    ({"ssl_keyfile": "/nonexistent/key.pem", "ssl_certfile": "/nonexistent/c.pem"}, "--ssl-keyfile"),
])
def test_checks_before_start(kw, words):
    with pytest.raises(ValueError, match=words.replace("-", r"\-").replace(".", r"\.")):
        check_before_start(_args(**kw))


def test_inline_chat_template_and_readable_model_pass(tmp_path):
    check_before_start(_args(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}", model=str(tmp_path)))


def test_unreadable_model_path_fails(tmp_path, monkeypatch):
    import tokenmill.entrypoints.openai.http_options as http_options

    monkeypatch.setattr(http_options.os, "access", lambda path, mode: False)  # as a non-root user with chmod 000
    with pytest.raises(ValueError, match="cannot be read"):
        check_before_start(_args(model=str(tmp_path)))


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "--port must be between 0 and 65535"),
    (["--chat-template", "missing.jinja"], "--chat-template missing.jinja: no such file"),
    (["/nonexistent/model-folder"], "Model path /nonexistent/model-folder does not exist"),
])
def test_start_up_errors_are_one_line_before_the_model_loads(argv, words, monkeypatch, capsys):
    import tokenmill.frontend.core_client as core_client

    def must_not_start(*args, **kwargs):
        raise AssertionError("the engine core must not start")

    monkeypatch.setattr(core_client.EngineCoreClient, "__init__", must_not_start)
    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and words in err and err.count("\n") == 1


def test_openai_entry_module_runs_tokenmill_serve():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.openai.api_server", "--port", "70000"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "--port must be between 0 and 65535" in done.stderr


def test_stats_line_only_with_activity():
    idle = SchedulerStats(num_steps=10)
    assert stats_line(idle, idle) is None and stats_line(None, None) is None
    busy = SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=200,
                          prefix_cache_hits=50, num_steps=30)
    assert stats_line(busy, idle) == ("Engine: 3 running, 1 waiting, KV cache 25.0% used, prefix cache hit rate "
                                      "25.0%, 20 steps since the last line")


class _FakeUvicorn:
    """`started` turns True on its third read, as uvicorn's does once the socket is bound."""

    def __init__(self, exit_first: bool = False) -> None:
        self.reads, self.should_exit = 0, exit_first
        sock = SimpleNamespace(getsockname=lambda: ("127.0.0.1", 43210))
        self.servers = [SimpleNamespace(sockets=[sock])]

    @property
    def started(self) -> bool:
        self.reads += 1
        return self.reads >= 3


def test_serving_line_waits_for_the_bind(caplog):
    opts = HTTPOptions(port=0)
    with caplog.at_level(logging.INFO, logger="tokenmill.entrypoints.openai.api_server"):
        server = _FakeUvicorn()
        asyncio.run(_log_when_bound(server, "m", opts, keyed=False))
        assert server.reads == 3
        assert caplog.messages == ["serving m on http://127.0.0.1:43210"]  # the bound port, not the asked 0
        caplog.clear()
        asyncio.run(_log_when_bound(_FakeUvicorn(exit_first=True), "m", opts, keyed=False))
        assert caplog.messages == []  # never bound (e.g. the port was taken): no serving line


def test_max_seq_len_to_capture_bounds_graph_replay():
    from tokenmill.worker.model_runner import ModelRunner as Runner

    runner = SimpleNamespace(max_model_len=4096,
                             config=SimpleNamespace(device_config=SimpleNamespace(max_seq_len_to_capture=1024)))
    assert Runner.graph_max_seq_len.fget(runner) == 1024
    runner.max_model_len = 512
    assert Runner.graph_max_seq_len.fget(runner) == 512
    runner.config.device_config.max_seq_len_to_capture = None  # the default: every length replays graphs
    runner.max_model_len = 131072
    assert Runner.graph_max_seq_len.fget(runner) == 131072


def test_vllm_attention_backend_maps_to_the_device_best(caplog):
    from tokenmill.config import EngineArgs

    with caplog.at_level(logging.INFO, logger="tokenmill.config.resolve"):
        config = EngineArgs(attention_backend="FLASH_ATTN").create_engine_config("server")
    assert config.device_config.attention_backend == "TORCH_SDPA"
    assert "--attention-backend FLASH_ATTN is vLLM's; tokenmill does not have it" in caplog.text
