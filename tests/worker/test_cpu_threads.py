"""CpuThreadGovernor: torch threads follow the CPUs that other processes leave free (fed fake CPU clocks)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.worker import cpu_threads


class _Clocks:
    """Fake /proc/stat busy seconds, own CPU seconds and monotonic time, advanced by `tick`."""

    def __init__(self, monkeypatch) -> None:
        self.now, self.busy, self.own = 100.0, 0.0, 0.0
        monkeypatch.setattr(cpu_threads.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda cpus: self.busy)
        monkeypatch.setattr(cpu_threads, "_own_seconds", lambda: self.own)

    def tick(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass while we use `ours` cores and other processes `others` cores."""
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def _governor(monkeypatch, max_threads: int = 2, cpus: int = 2):
    set_calls: list[int] = []
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", set_calls.append)
    gov = cpu_threads.CpuThreadGovernor(max_threads=max_threads, interval_s=1.0)
    gov.cpus = set(range(cpus))
    return gov, set_calls


def _steps(gov, clocks, n: int, seconds: float, ours: float, others: float, gap: float = 0.001) -> int:
    """`n` model steps of `seconds` each, `gap` apart; returns the thread count the last one ran with."""
    threads = gov.threads
    for _ in range(n):
        threads = gov.step()
        clocks.tick(seconds, ours, others)
        gov.step_done()
        clocks.tick(gap, ours=0.0, others=others)
    return threads


def test_threads_drop_with_a_hog_and_come_back(monkeypatch):
    clocks = _Clocks(monkeypatch)
    gov, set_calls = _governor(monkeypatch)
    assert _steps(gov, clocks, 15, 0.1, ours=2.0, others=0.0) == 2 and set_calls == []  # both CPUs ours
    assert _steps(gov, clocks, 5, 0.1, ours=1.3, others=0.7) == 2  # under interval_s of busy time so far
    _steps(gov, clocks, 15, 0.1, ours=1.3, others=0.7)
    assert set_calls == [1]  # a hog took ~0.7 of a core while we ran
    _steps(gov, clocks, 12, 0.1, ours=1.0, others=1.0)
    assert set_calls == [1]
    _steps(gov, clocks, 24, 0.1, ours=1.0, others=0.1)
    assert set_calls == [1, 2] and gov.threads == 2  # the hog left


def test_other_processes_work_while_the_engine_idles_does_not_count(monkeypatch):
    clocks = _Clocks(monkeypatch)
    gov, set_calls = _governor(monkeypatch)
    _steps(gov, clocks, 15, 0.1, ours=2.0, others=0.0)
    clocks.tick(4.0, ours=0.02, others=1.0)  # no step for 4 s: a client starts up (imports, tokenizer)
    _steps(gov, clocks, 25, 0.1, ours=1.9, others=0.05)  # its requests: a little CPU beside our steps
    assert set_calls == [] and gov.threads == 2


def test_a_hog_beside_steps_longer_than_the_interval_counts(monkeypatch):
    # 2.5 s prefill chunks whose threads sleep at barriers (our CPU 0.4 cores) beside a hog on one core.
    clocks = _Clocks(monkeypatch)
    gov, set_calls = _governor(monkeypatch)
    _steps(gov, clocks, 3, 2.5, ours=0.4, others=1.0)
    assert set_calls == [1]


@pytest.mark.parametrize(("bursts", "steps", "seconds", "idle"), [
    (3, 8, 0.1, 2.2),  # a request every 3 s (0.8 s of steps, then 2.2 s idle): the busy periods add up
    (6, 1, 0.3, 0.5),  # one-step requests (max_tokens=1, scoring) 0.5 s apart: every period a single step
])
def test_a_hog_beside_bursts_of_requests_counts(monkeypatch, bursts, steps, seconds, idle):
    clocks = _Clocks(monkeypatch)
    gov, set_calls = _governor(monkeypatch)
    for _ in range(bursts):
        _steps(gov, clocks, steps, seconds, ours=1.0, others=1.0)
        clocks.tick(idle, ours=0.0, others=1.0)
    assert set_calls == [1]


def test_busy_time_before_a_long_idle_is_dropped(monkeypatch):
    # 0.9 s of busy time under a hog, an hour idle, then 0.2 s of clean steps: no estimate from the stale part.
    clocks = _Clocks(monkeypatch)
    gov, set_calls = _governor(monkeypatch)
    _steps(gov, clocks, 9, 0.1, ours=1.0, others=1.0, gap=0.0)
    clocks.tick(3600.0, ours=0.0, others=0.0)
    _steps(gov, clocks, 2, 0.1, ours=2.0, others=0.0)
    assert set_calls == [] and gov._acc[0] < 0.5


def test_never_above_the_configured_count_nor_below_one(monkeypatch):
    clocks = _Clocks(monkeypatch)
    gov, set_calls = _governor(monkeypatch, max_threads=3, cpus=8)
    _steps(gov, clocks, 12, 0.2, ours=3.0, others=0.0)
    assert gov.threads == 3 and set_calls == []
    _steps(gov, clocks, 12, 0.2, ours=1.0, others=12.0)  # more busy than CPUs (an overcommitted box)
    assert gov.threads == 1


def test_without_proc_stat_it_keeps_its_threads(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda cpus: None)
    gov = cpu_threads.CpuThreadGovernor(max_threads=2, interval_s=0.0)
    for _ in range(3):
        assert gov.step() == 2 == gov.threads
        gov.step_done()


def test_reads_this_machine():
    busy = cpu_threads._busy_seconds(set(range(torch.get_num_threads() + 64)))
    assert busy is None or busy > 0
    assert cpu_threads._own_seconds() > 0
