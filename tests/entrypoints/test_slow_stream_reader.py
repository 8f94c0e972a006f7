"""A streamed chat completion whose reader falls behind the engine: same text as the non-streamed answer.

The real `AsyncLLM` front end (tokenizer, chat template, OutputProcessor,
OutputStream) and the real HTTP app run in-process; only the engine core is
a script: every step gives each running request the next token of SCRIPT
(what a greedy model would answer every time). The core's reader is driven
by hand, several flushes (one per step) per event-loop turn, so the stream's
consumer reads after several outputs arrived: the stream merges them, the
handler diffs against what it sent, and the chunks still add up to the text.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from fake_engine import asgi_call

from tokenmill.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, MessageKind

SCRIPT = " The capital of France is Paris. Ça coûte 5 €, 🙂 ok."


class ScriptedClient:
    """`EngineCoreClient`'s interface, in-process: `step()` gives every running request its next SCRIPT token."""

    is_alive = True
    reader_running = True
    dead_reason = None

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.running: dict[str, tuple[EngineCoreRequest, int]] = {}

    def add_request(self, request: EngineCoreRequest) -> None:
        self.running[request.request_id] = (request, 0)

    def abort_requests(self, request_ids: list[str], status: object = None) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def shutdown(self) -> None:
        self.running.clear()

    def step(self) -> EngineCoreOutputs:
        outs = []
        for rid, (req, n) in list(self.running.items()):
            done = n + 1 >= min(req.sampling_params.max_tokens, len(self.script))
            outs.append(EngineCoreOutput(rid, [self.script[n]], finish_reason=FinishReason.LENGTH if done else None))
            if done:
                del self.running[rid]
            else:
                self.running[rid] = (req, n + 1)
        return EngineCoreOutputs(outs, time.time())


@pytest.fixture(scope="module")
def front_end(smollm2_gguf):
    """(AsyncLLM over a ScriptedClient, the client); the model config is SmolLM2's (its tokenizer and template)."""
    import torch

    from tokenmill.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from tokenmill.frontend.async_llm import AsyncLLM
    from tokenmill.model_loader.tokenizer import load_tokenizer

    hf = SimpleNamespace(vocab_size=49152, eos_token_id=2)
    mc = ModelConfig(model=smollm2_gguf, model_path=smollm2_gguf, gguf_file=smollm2_gguf, tokenizer=smollm2_gguf,
                     skip_tokenizer_init=False, load_format="gguf", dtype="float32", seed=0, max_model_len=256,
                     architecture="LlamaForCausalLM", hf_config=hf)
    config = EngineConfig(mc, CacheConfig(block_size=16), SchedulerConfig(8, 256, 256), ParallelConfig(),
                          DeviceConfig())
    client = ScriptedClient(load_tokenizer(smollm2_gguf).encode(SCRIPT, add_special_tokens=False))
    threads = torch.get_num_threads()  # AsyncLLM sets 1 for its process; leave the test process as it was
    try:
        llm = AsyncLLM(config, client)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)
    return llm, client


async def _serve(app, llm, client, body: dict, steps_per_turn: int, pending: list[int]) -> tuple[int, bytes]:
    """One HTTP request, with the core's reader run by hand: `steps_per_turn` steps, each flushed, per turn.

    `pending` gets the stream's unread outputs after each flush.
    """

    async def reader() -> None:
        while True:
            for _ in range(steps_per_turn):
                if client.running:
                    llm._on_message(MessageKind.OUTPUTS, client.step())
                    streams = list(llm._queues.values())
                    llm._flush_outputs()
                    pending.extend(s.num_pending() for s in streams)
            await asyncio.sleep(0)

    task = asyncio.ensure_future(reader())
    try:
        return await asgi_call(app, "POST", "/v1/chat/completions", body)
    finally:
        task.cancel()


def test_slowly_read_chat_stream_adds_up_to_the_non_streamed_answer(front_end):
    from tokenmill.entrypoints.openai.api_server import build_app

    llm, client = front_end
    app = build_app(llm, ["smollm2"])
    num_tokens = len(client.script)
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 64}
    status, raw = asyncio.run(_serve(app, llm, client, dict(body), 1, []))
    assert status == 200, raw
    full = json.loads(raw)
    answer = full["choices"][0]["message"]["content"]
    assert answer == SCRIPT and full["choices"][0]["finish_reason"] == "length"

    pending: list[int] = []
    status, raw = asyncio.run(_serve(app, llm, client, {**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}, 3, pending))
    assert status == 200
    events = [e[len("data: "):] for e in raw.decode().split("\n\n")[:-1]]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert "".join(d["delta"].get("content", "") for d in deltas) == answer
    assert [d["finish_reason"] for d in deltas][-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == num_tokens
    # The reader fell behind: outputs arrived while one was unread, and were merged into it.
    assert len(pending) == num_tokens and max(pending) == 1 and pending.count(1) == num_tokens
    assert 1 < len(deltas) - 1 <= -(-num_tokens // 3) + 1  # role chunk, then one chunk per read at most
    assert not llm._queues and not client.running
