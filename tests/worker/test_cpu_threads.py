"""CpuThreadGovernor: torch threads follow the CPUs that other processes leave free (fed fake CPU clocks)."""

from __future__ import annotations

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


def test_threads_drop_with_a_hog_and_come_back(monkeypatch):
    clocks = _Clocks(monkeypatch)
    set_calls: list[int] = []
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", set_calls.append)
    gov = cpu_threads.CpuThreadGovernor(max_threads=2, interval_s=1.0)
    gov.cpus = {0, 1}
    clocks.tick(1.5, ours=2.0, others=0.0)
    assert gov.step() == 2 and set_calls == []  # both CPUs ours: nothing changes
    clocks.tick(0.5, ours=1.3, others=0.7)
    assert gov.step() == 2  # under interval_s since the last estimate: not re-estimated yet
    clocks.tick(0.6, ours=1.3, others=0.7)
    assert gov.step() == 1 and set_calls == [1]  # a hog took ~0.7 of a core over the last 1.1 s
    clocks.tick(1.0, ours=1.0, others=1.0)
    assert gov.step() == 1 and set_calls == [1]
    clocks.tick(1.0, ours=1.0, others=0.1)
    assert gov.step() == 2 and set_calls == [1, 2]  # the hog left


def test_other_processes_work_while_the_engine_idles_does_not_count(monkeypatch):
    clocks = _Clocks(monkeypatch)
    set_calls: list[int] = []
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", set_calls.append)
    gov = cpu_threads.CpuThreadGovernor(max_threads=2, interval_s=1.0)
    gov.cpus = {0, 1}
    clocks.tick(1.5, ours=2.0, others=0.0)
    assert gov.step() == 2
    clocks.tick(4.0, ours=0.02, others=1.0)  # no step for 4 s: a client starts up (imports, tokenizer)
    assert gov.step() == 2 and set_calls == []  # that window is dropped, not read as a hog
    clocks.tick(1.1, ours=1.9, others=0.05)  # the client's requests: a little CPU beside our steps
    assert gov.step() == 2 and set_calls == []
    clocks.tick(3.0, ours=1.2, others=0.8)  # one long step under a real hog: our own CPU shows we ran
    assert gov.step() == 1 and set_calls == [1]
    clocks.tick(4.0, ours=0.0, others=1.0)  # idle again: the count stays as it was
    assert gov.step() == 1 and set_calls == [1]


def test_never_above_the_configured_count_nor_below_one(monkeypatch):
    clocks = _Clocks(monkeypatch)
    monkeypatch.setattr(cpu_threads.torch, "set_num_threads", lambda n: None)
    gov = cpu_threads.CpuThreadGovernor(max_threads=3, interval_s=1.0)
    gov.cpus = set(range(8))
    clocks.tick(2.0, ours=3.0, others=0.0)
    assert gov.step() == 3
    clocks.tick(2.0, ours=1.0, others=12.0)  # more busy than CPUs (an overcommitted box)
    assert gov.step() == 1


def test_without_proc_stat_it_keeps_its_threads(monkeypatch):
    monkeypatch.setattr(cpu_threads, "_busy_seconds", lambda cpus: None)
    gov = cpu_threads.CpuThreadGovernor(max_threads=2, interval_s=0.0)
    assert gov.step() == 2 == gov.threads


def test_reads_this_machine():
    busy = cpu_threads._busy_seconds(set(range(torch.get_num_threads() + 64)))
    assert busy is None or busy > 0
    assert cpu_threads._own_seconds() > 0
