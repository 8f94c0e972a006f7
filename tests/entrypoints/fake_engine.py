"""A fake engine and a tiny in-process ASGI client for fast HTTP-layer tests (see conftest.py).

The fake speaks `AsyncLLM`'s interface (`add_request` -> stream,
`apply_chat_template`, `tokenizer`, ...) without a model: a text prompt's
token ids are its characters' code points, and completion token `i` is id
`100 + i` with text `" w<i>"`, so tests can compute the expected text and
counts independently of the server code.

Fakes build each step's output as a cumulative snapshot and queue it with
`FakeStream.push`, which hands it over the way the real engine does for the
request's `output_kind`: for DELTA (what the servers ask for when
streaming) only what is new since the request's previous output, so a
handler that took a DELTA output for the whole output so far fails the tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from tokenmill.core.outputs import SchedulerStats
from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams


class FakeTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f" w{i - 100}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def fake_completion_text(num_tokens: int) -> str:
    return "".join(f" w{i}" for i in range(num_tokens))


class FakeStream:
    """Replays precomputed outputs; `close()` records unfinished ids as aborted."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.items: list[RequestOutput] = []
        self.unfinished: set[str] = set()
        self.hang = False
        # (request id, completion index) -> its last pushed snapshot (DELTA bookkeeping)
        self._pushed: dict[tuple[str, int], CompletionOutput] = {}

    def push(self, out: RequestOutput, kind: RequestOutputKind) -> None:
        """Queue `out`, a cumulative snapshot, as the engine delivers outputs of `kind`.

        DELTA: each completion keeps only the text, token ids and logprobs
        added since the request's previous output; FINAL_ONLY: only the
        finished output is queued; CUMULATIVE: as it is.
        """
        if kind == RequestOutputKind.FINAL_ONLY and not out.finished:
            return
        if kind == RequestOutputKind.DELTA:
            comps = []
            for comp in out.outputs:
                prev = self._pushed.get((out.request_id, comp.index))
                self._pushed[(out.request_id, comp.index)] = comp
                text0, ids0, lps0 = (len(prev.text), len(prev.token_ids), len(prev.logprobs or [])) if prev \
                    else (0, 0, 0)
                comps.append(dataclasses.replace(comp, text=comp.text[text0:], token_ids=comp.token_ids[ids0:],
                                                 logprobs=None if comp.logprobs is None else comp.logprobs[lps0:]))
            out = dataclasses.replace(out, outputs=comps)
        self.items.append(out)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.hang:
            await asyncio.Event().wait()  # a request that never produces output
        if not self.items:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        out = self.items.pop(0)
        if isinstance(out, BaseException):
            raise out
        if out.finished:
            self.unfinished.discard(out.request_id)
        return out

    async def next_ready(self) -> list[RequestOutput]:
        """As `OutputStream.next_ready`: one output, plus up to `engine.ready_group - 1` more queued behind it."""
        outs = [await self.__anext__()]
        while len(outs) < self.engine.ready_group and self.items and not isinstance(self.items[0], BaseException):
            outs.append(await self.__anext__())
        return outs

    def close(self) -> None:
        self.engine.aborted.extend(sorted(self.unfinished))
        self.unfinished.clear()


class FakeEngine:
    """Deterministic stand-in for AsyncLLM (max_model_len 64)."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_model_len = 64
        self.default_sampling_kwargs: dict[str, Any] = {}
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.aborted: list[str] = []
        self.healthy = True
        # Outputs a stream hands over per `next_ready` (more than 1: a consumer that fell behind).
        self.ready_group = 1
        # The keyword arguments of the last apply_chat_template call.
        self.template_kwargs: dict[str, Any] = {}

    async def check_health(self) -> None:
        if not self.healthy:
            raise RuntimeError("fake core is dead")

    def get_scheduler_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=2, max_num_running_reqs=5, num_steps=7)

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        self.template_kwargs = {"add_generation_prompt": add_generation_prompt, **kwargs}
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant:"
        return self.tokenizer.encode(text)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, priority: int = 0,
                    stream: FakeStream | None = None) -> FakeStream:
        text_prompt = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict):  # {"prompt": text, "prompt_token_ids": ids} (add_special_tokens, cache_salt)
            text_prompt = prompt.get("prompt")
            prompt = prompt["prompt_token_ids"] if prompt.get("prompt_token_ids") is not None else prompt["prompt"]
        if isinstance(prompt, str):
            if prompt == "boom":
                raise RuntimeError("simulated engine bug")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("The prompt is empty.")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens.")
        self.requests[request_id] = (ids, params)
        stream = stream or FakeStream(self)
        stream.unfinished.add(request_id)
        # Prompt logprobs: position i holds token ids[i] at logprob -i (rank i) and token 7 at -0.25 (rank 1).
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [{ids[i]: Logprob(-float(i), i, chr(ids[i])), 7: Logprob(-0.25, 1, "x")}
                                        for i in range(1, len(ids))]
        steps = range(1, max_tokens + 1)
        if params.output_kind == RequestOutputKind.FINAL_ONLY:
            steps = range(max_tokens, max_tokens + 1)
        for k in steps:
            done = k == max_tokens
            comps = []
            for idx in range(params.n):
                logprobs = None
                if params.logprobs is not None:
                    logprobs = [{100 + i: Logprob(-0.5, 1, f" w{i}"), 7: Logprob(-2.0, 2, " x")} for i in range(k)]
                comps.append(CompletionOutput(index=idx, text=fake_completion_text(k),
                                              token_ids=list(range(100, 100 + k)), logprobs=logprobs,
                                              finish_reason="length" if done else None))
            stream.push(RequestOutput(request_id, text_prompt, ids, comps, done, prompt_logprobs=prompt_logprobs),
                        params.output_kind)
        stream.hang = prompt == "hang"
        if prompt == "die":  # the core dies after the first output
            from tokenmill.frontend.core_client import EngineDeadError

            stream.items[1:] = [EngineDeadError("core process exited")]
        return stream


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}


async def asgi_call(app: Any, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
    """Run one HTTP request through the ASGI app in-process; returns (status, body bytes)."""
    if body is None:
        raw = b""
    elif isinstance(body, bytes):
        raw = body
    else:
        raw = json.dumps(body).encode()
    done = asyncio.Event()
    sent_body = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(_scope(method, path), receive, send)
    except Exception:
        if not status:
            raise
    return status, b"".join(chunks)
