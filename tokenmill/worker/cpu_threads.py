"""A CPU worker's torch thread count, lowered while other processes hold its cores and raised back after.

Every parallel region of an OpenMP thread team (torch's ops, tokenmill's C
kernels: ~150-300 per decode step) ends at a barrier, so a step runs at the
pace of the team's slowest thread. When another process takes one of two
cores, the thread that shares it with the intruder gets half of it in
scheduler slices of milliseconds, and each region waits for it: measured on
the 2-core box, SmolLM2 decode steps went from ~20 ms at one thread to
150-700 ms at two (docs/benchmarks.md, "CPU threads under a CPU hog"). One
thread per core that is actually free avoids the barriers' wait, so
throughput falls with the cores lost instead of by 10x.

Once per `interval_s` (checked at each step, read from /proc/stat and
`os.times()`), `CpuThreadGovernor.step` estimates how many of this
process's CPUs other processes kept busy (all CPU time on them minus ours
and our parent's, the front end's)
and sets `torch.set_num_threads(round(cpus - others))`, clamped to
[1, max_threads]. Linux only (elsewhere it keeps max_threads);
TOKENMILL_CPU_ADAPTIVE_THREADS=0 turns it off.

Only the time the engine is busy counts. A step's start (`step`) and end
(`step_done`) bound it; steps less than `IDLE_GAP_S` apart form one busy
period, and the CPU samples are taken at a period's start and at each
step's end, so the seconds between periods, when nothing of ours runs, are
left out. An estimate needs `interval_s` of busy time, gathered over one or
several periods (a period of a single step counts too); busy time from
before an idle gap of `STALE_IDLE_INTERVALS` intervals is dropped. Served
at concurrency 1 on the quiet 2-core box, a window over the idle seconds
before a benchmark's first request went 2 -> 1 thread
on the bench client's start-up (imports, tokenizer, prompt sampling) and
back a second later (benchmarks/serve_cpu_per_token.py); a hog that runs
beside short bursts of requests, or beside steps longer than `interval_s`,
still counts, since it takes CPU while ours runs.
"""

from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)


def _busy_seconds(cpus: set[int]) -> float | None:
    """Non-idle CPU seconds of `cpus` since boot (all processes), from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    ticks = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            values = [int(v) for v in fields[1:8]]  # user nice system idle iowait irq softirq
            ticks += sum(values) - values[3] - values[4]
    return ticks / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU seconds of this process and its parent: the engine core's parent is the front end (API server,
    detokenizer), whose work at high concurrency must not read as another process taking a core."""
    t = os.times()
    own = t.user + t.system
    try:
        with open(f"/proc/{os.getppid()}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
        return own + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return own


IDLE_GAP_S = 0.1  # steps further apart than this start a new busy period (the gap is not measured)
STALE_IDLE_INTERVALS = 10  # an idle gap of this many intervals drops the busy time gathered before it


class CpuThreadGovernor:
    """Sets torch's thread count to the CPUs other processes leave free (see the module docstring).

    Call `step()` before each model step and `step_done()` after it.

    Args:
        max_threads: the configured thread count (never exceeded).
        interval_s: busy seconds per estimate.
    """

    def __init__(self, max_threads: int, interval_s: float = 1.0) -> None:
        self.max_threads = max(1, max_threads)
        self.interval_s = interval_s
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.threads = self.max_threads
        # (seconds, busy CPU seconds, own CPU seconds) of the busy periods closed since the last estimate
        self._acc = (0.0, 0.0, 0.0)
        self._start: tuple[float, float, float] | None = None  # sample at the open period's start
        self._end: tuple[float, float, float] | None = None  # sample at the open period's last step end

    def _sample(self) -> tuple[float, float, float] | None:
        busy = _busy_seconds(self.cpus)
        return None if busy is None else (time.monotonic(), busy, _own_seconds())

    def step(self) -> int:
        """Before a model step: re-estimate once `interval_s` of busy time has gathered; returns the thread
        count in force."""
        now = time.monotonic()
        if self._start is not None and self._end is not None and now - self._end[0] > IDLE_GAP_S:
            # The engine idled since its last step: close that period; the gap is not measured. After a long
            # idle (STALE_IDLE_INTERVALS intervals) the busy time gathered before it is dropped: too old to
            # say what other processes do now.
            stale = now - self._end[0] > STALE_IDLE_INTERVALS * self.interval_s
            closed = tuple(a + e - s for a, s, e in zip(self._acc, self._start, self._end))
            self._acc = (0.0, 0.0, 0.0) if stale else closed
            self._start = self._end = None
        window = self._acc
        if self._start is not None and self._end is not None:
            window = tuple(a + e - s for a, s, e in zip(self._acc, self._start, self._end))
        if window[0] >= self.interval_s and window[0] > 0.0:
            self._estimate(*window)
            self._acc = (0.0, 0.0, 0.0)
            if self._start is not None and self._end is not None:
                self._start = self._end  # the open period goes on from its last step's end
        if self._start is None:
            self._start = self._sample()
            self._end = None
        return self.threads

    def _estimate(self, seconds: float, busy: float, own: float) -> None:
        """Set the thread count from `seconds` of our busy time, in which all processes used `busy` CPU seconds
        and we `own`."""
        others = max(0.0, (busy - own) / seconds)  # cores, averaged over our busy time
        target = min(self.max_threads, max(1, round(len(self.cpus) - others)))
        if target != self.threads:
            logger.info("CPU threads %d -> %d: other processes kept %.1f of %d CPUs busy (TOKENMILL_CPU_ADAPTIVE_"
                        "THREADS=0 keeps %d)", self.threads, target, others, len(self.cpus), self.max_threads)
            torch.set_num_threads(target)
            self.threads = target

    def step_done(self) -> None:
        """After a model step: sample the CPU clocks at its end (~30 us: /proc/stat and the parent's stat)."""
        if self._start is not None:
            self._end = self._sample()
