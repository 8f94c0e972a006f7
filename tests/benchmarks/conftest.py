"""Fixtures for benchmark tests: a word-level fake tokenizer and a fake OpenAI SSE server."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import ClassVar

import pytest
from aiohttp import web


class WordTokenizer:
    """Token i is the word f"w{i}"; id 0 is a special token. encode/decode round-trip exactly."""

    all_special_ids: ClassVar[list[int]] = [0]

    def __init__(self, vocab_size: int = 50):
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


@pytest.fixture
def word_tokenizer() -> WordTokenizer:
    return WordTokenizer()


class FakeOpenAIServer:
    """An aiohttp app on 127.0.0.1 streaming `max_tokens` chunks of "tok " each.

    Timing: `first_delay_s` before the first chunk, `gap_s` between chunks.
    Prompts containing FAIL get HTTP 500; STREAMERR gets one chunk then an
    error object in the stream. Prompts containing PAIRS get two tokens per
    chunk. With `api_key` set, `GET /v1/models` answers 401 unless the request
    carries it as a bearer token. With `stream_options.continuous_usage_stats` every content chunk
    carries the cumulative usage, unless the prompt contains NOUSAGE or
    TOKENIDS; TOKENIDS chunks carry their `token_ids` instead. Request bodies
    are kept in `bodies`.
    """

    first_delay_s = 0.03
    gap_s = 0.01

    def __init__(self):
        self.api_key: str | None = None
        self.bodies: list[dict] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _models(self, request: web.Request) -> web.Response:
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Invalid API key.", "code": "invalid_api_key"}},
                                     status=401)
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if "FAIL" in prompt:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict | str) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        if chat:  # a role-only first chunk carries no content and must not count as the first token
            await send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(self.first_delay_s)
        n = body["max_tokens"]
        per_chunk = 2 if "PAIRS" in prompt else 1
        continuous = ((body.get("stream_options") or {}).get("continuous_usage_stats")
                      and "NOUSAGE" not in prompt and "TOKENIDS" not in prompt)
        for i in range(0, n, per_chunk):
            if i:
                await asyncio.sleep(self.gap_s)
            k = min(per_chunk, n - i)
            choice = {"index": 0, "delta": {"content": "tok " * k}} if chat else {"index": 0, "text": "tok " * k}
            if "TOKENIDS" in prompt:
                choice["token_ids"] = list(range(i, i + k))
            chunk = {"choices": [choice]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": len(prompt.split()), "completion_tokens": i + k,
                                  "total_tokens": len(prompt.split()) + i + k}
            await send(chunk)
            if "STREAMERR" in prompt:
                await send({"error": {"message": "engine died"}})
                return resp
        await send({"choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                                             "total_tokens": len(prompt.split()) + n}})
        await send("[DONE]")
        return resp

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        assert self._ready.wait(10), "fake server did not start"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def fake_server():
    server = FakeOpenAIServer().start()
    yield server
    server.stop()
