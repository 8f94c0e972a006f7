"""A scripted engine core for testing the core process and its client without a model.

Each running request emits one token per step (token id = its output
position) and finishes with LENGTH after `max_tokens`. `engine_config.mode`
picks a failure: "bad_config" (ValueError at start), "crash_on_step"
(RuntimeError in the first step). A prompt whose first token is 666 is
refused by `add_request` with a ValueError.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from tokenmill.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)


def make_config(mode: str = "ok") -> SimpleNamespace:
    return SimpleNamespace(mode=mode, cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=12),
                           model_config=SimpleNamespace(max_model_len=128))


class FakeCore:
    def __init__(self, engine_config: SimpleNamespace) -> None:
        if engine_config.mode == "bad_config":
            raise ValueError("max_model_len 99999 does not fit in the KV cache; use at most 192.")
        self.mode = engine_config.mode
        self.running: dict[str, tuple[EngineCoreRequest, int]] = {}
        self.max_running = 0
        self.steps = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.prompt_token_ids[0] == 666:
            raise ValueError("prompt token 666 is not allowed")
        self.running[request.request_id] = (request, 0)

    def abort_requests(self, request_ids: list[str], status: object = None) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.running), max_num_running_reqs=self.max_running,
                              num_steps=self.steps)

    def step(self) -> EngineCoreOutputs:
        if self.mode == "crash_on_step":
            raise RuntimeError("simulated kernel failure")
        time.sleep(0.05)  # a step takes time, so requests sent meanwhile join the batch
        self.steps += 1
        self.max_running = max(self.max_running, len(self.running))
        outs = []
        for rid, (req, n) in list(self.running.items()):
            done = n + 1 >= req.sampling_params.max_tokens
            # The EOS id must have survived the trip: echo it as the stop reason.
            stop_ids = sorted(req.sampling_params.all_stop_token_ids)
            outs.append(EngineCoreOutput(rid, [n], finish_reason=FinishReason.LENGTH if done else None,
                                         stop_reason=stop_ids[0] if stop_ids else None))
            if done:
                del self.running[rid]
            else:
                self.running[rid] = (req, n + 1)
        return EngineCoreOutputs(outs, 0.0, self.get_stats())
