"""UniProcExecutor over a dummy-weight tiny Llama: the worker lifecycle end to end."""

from __future__ import annotations

import pytest
import torch
from tiny_runner import make_tiny_runner as _runner

from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.executor.uniproc import UniProcExecutor
from tokenmill.sampling_params import SamplingParams


def test_lifecycle_and_greedy_decode():
    cfg = _runner().config  # tiny Llama config, load_format dummy
    cfg.cache_config.num_gpu_blocks_override = 20
    ex = UniProcExecutor(cfg)
    n = ex.determine_num_available_blocks()
    assert n == 20
    ex.initialize_kv_cache(n)
    assert cfg.cache_config.num_gpu_blocks == 20
    kv = ex.worker.model_runner.kv_caches
    assert len(kv) == 2 and kv[0].shape == (2, 20, 4, 2, 8) and kv[0].dtype == torch.float32
    new = NewRequestData("x", [1, 2, 3, 4, 5], [], SamplingParams(temperature=0.0), [3, 4], 0)
    out = ex.execute_model(SchedulerOutput([new], CachedRequestData(), {"x": 5}, 5))
    assert out.req_ids == ["x"] and len(out.sampled_token_ids[0]) == 1
    out2 = ex.execute_model(SchedulerOutput([], CachedRequestData(["x"], [[]], [5]), {"x": 1}, 1))
    assert len(out2.sampled_token_ids[0]) == 1
    empty = ex.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0, {"x"}))
    assert empty.req_ids == [] and ex.worker.model_runner.input_batch.num_reqs == 0
    ex.shutdown()
    ex.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        ex.execute_model(SchedulerOutput([], CachedRequestData(), {}, 0))
