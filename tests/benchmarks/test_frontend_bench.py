"""benchmarks/frontend_bench.py's parts that decide its numbers: the ideal schedule and the synthetic core."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tokenmill.engine.messages import EngineCoreRequest, FinishReason
from tokenmill.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("frontend_bench", ROOT / "benchmarks" / "frontend_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ideal_steps_list_schedules_requests_in_order(bench):
    # 2 slots: [3] and [1] start; the 1 ends at step 1, its slot takes a 2 (ends at 3); then the last 2 ends at 5.
    assert bench.ideal_steps([3, 1, 2, 2], 2) == 5
    assert bench.ideal_steps([5], 4) == 5
    assert bench.ideal_steps([1, 1, 1, 1], 2) == 2
    assert bench.ideal_steps([], 8) == 0


def test_synthetic_core_gives_one_token_per_step_and_finishes_at_max_tokens(bench, monkeypatch, tmp_path):
    monkeypatch.setenv(bench.ENV_STEP_MS, "0")
    monkeypatch.setenv(bench.ENV_VOCAB, "10")
    monkeypatch.setenv(bench.ENV_STATS, str(tmp_path / "core.jsonl"))
    core = bench.SyntheticCore(None)
    for rid, n in (("a", 2), ("b", 3)):
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=[1],
                                           sampling_params=SamplingParams(max_tokens=n, ignore_eos=True)))
    got: dict[str, list[int]] = {"a": [], "b": []}
    finished = {}
    while core.has_unfinished_requests():
        out = core.step()
        for eco in out.outputs:
            assert len(eco.new_token_ids) == 1 and 0 <= eco.new_token_ids[0] < 10
            got[eco.request_id] += eco.new_token_ids
            if eco.finish_reason is not None:
                finished[eco.request_id] = eco.finish_reason
    assert {k: len(v) for k, v in got.items()} == {"a": 2, "b": 3}
    assert finished == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert core.get_stats().num_steps == 3 and core.get_stats().max_num_running_reqs == 2
    (period,) = [line for line in (tmp_path / "core.jsonl").read_text().splitlines()]
    assert '"steps": 3' in period and '"tokens": 5' in period
