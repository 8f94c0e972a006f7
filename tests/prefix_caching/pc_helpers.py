"""Helpers for the prefix-caching tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import dataclasses


def use_scheduler(llm, *, caching: bool, num_blocks: int | None = None, **sched_overrides):
    """Give `llm`'s engine a fresh `Scheduler` (empty prefix cache, zeroed counters).

    Builds it exactly as `EngineCore` does from `--enable-prefix-caching`,
    `--num-gpu-blocks-override` and the scheduler flags, so one loaded model
    serves every configuration. With `num_blocks` smaller than the worker's
    KV tensor, the rest of the tensor simply stays unused.

    Returns:
        The new scheduler.
    """
    from tokenmill.core.scheduler import Scheduler

    core = llm.llm_engine.engine_core
    old = core.scheduler
    assert not old.has_unfinished_requests(), "swap schedulers only between runs"
    cache_cfg = dataclasses.replace(core.engine_config.cache_config, enable_prefix_caching=caching)
    sched_cfg = dataclasses.replace(core.engine_config.scheduler_config, **sched_overrides)
    core.scheduler = Scheduler(sched_cfg, cache_cfg, num_blocks or core.engine_config.cache_config.num_gpu_blocks)
    # Requests finished in the last step are still to be dropped by the worker.
    core.scheduler.finished_req_ids = set(old.finished_req_ids)
    return core.scheduler
