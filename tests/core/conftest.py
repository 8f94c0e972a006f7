"""Fixtures for core/ tests: tiny requests, schedulers and a fake model runner."""

from __future__ import annotations

import itertools

import pytest

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.sched_output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 16
EOS = 2


@pytest.fixture
def make_request():
    """Factory: make_request(req_id, num_prompt_tokens | prompt list, **options) -> Request."""
    clock = itertools.count()

    def _make(
        req_id: str,
        prompt: int | list[int] = 20,
        *,
        max_tokens: int = 8,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        start: int = 1000,
        max_model_len: int = 1024,
        logprobs: int | None = None,
    ) -> Request:
        prompt_ids = list(range(start, start + prompt)) if isinstance(prompt, int) else list(prompt)
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            stop_token_ids=stop_token_ids,
            logprobs=logprobs,
        )
        params.update_from_generation_config({}, EOS)
        core_req = EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=float(next(clock)) if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
        )
        return Request(core_req, max_tokens=min(max_tokens, max_model_len - len(prompt_ids)))

    return _make


@pytest.fixture
def make_scheduler():
    """Factory: make_scheduler(num_blocks=12, max_num_batched_tokens=64, ...) -> Scheduler."""

    def _make(
        num_blocks: int = 12,
        *,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        max_model_len: int = 1024,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        async_scheduling: bool = False,
        long_prefill_token_threshold: int = 0,
        max_prefill_tokens_with_decodes: int = 0,
    ) -> Scheduler:
        sched_cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=policy,
            async_scheduling=async_scheduling,
            long_prefill_token_threshold=long_prefill_token_threshold,
            max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
        )
        cache_cfg = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching)
        return Scheduler(sched_cfg, cache_cfg, num_blocks)

    return _make


def fake_runner_output(scheduler: Scheduler, out: SchedulerOutput, token: int | dict[str, int] = 7) -> ModelRunnerOutput:
    """What a worker would return: one token for each request whose span reaches its end.

    Mirrors the contract in sched_output.py: a request samples only when
    num_computed_tokens (before the step) + num_scheduled reaches num_tokens.
    `scheduler.schedule()` has already advanced num_computed_tokens, so the
    test is `req.num_computed_tokens == req.num_tokens`.
    """
    req_ids = list(out.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        tok = token[rid] if isinstance(token, dict) else token
        sampled.append([tok] if req.num_computed_tokens == req.num_tokens else [])
    logprobs = LogprobsLists(
        logprob_token_ids=[[s[0], s[0] + 1] if s else [] for s in sampled],
        logprobs=[[-0.5, -1.5] if s else [] for s in sampled],
        sampled_token_ranks=[1 if s else 0 for s in sampled],
    )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=logprobs,
    )


@pytest.fixture
def eos() -> int:
    """The EOS id every test request carries (as from a generation config)."""
    return EOS


@pytest.fixture
def runner_output():
    """runner_output(scheduler, scheduler_output, token=7) -> fake ModelRunnerOutput."""
    return fake_runner_output


@pytest.fixture
def step():
    """step(scheduler, token=7) -> (SchedulerOutput, EngineCoreOutputs): one engine step."""

    def _step(scheduler: Scheduler, token: int | dict[str, int] = 7):
        out = scheduler.schedule()
        return out, scheduler.update_from_output(out, fake_runner_output(scheduler, out, token))

    return _step
