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

A window that spans an idle engine (no step for longer than `interval_s`
and less than half a core of our own CPU over the window) measures what
other processes did while nothing of ours ran: it starts a new window and
changes nothing. Served at concurrency 1 on the quiet 2-core box, the
first step of each benchmark run otherwise went 2 -> 1 thread on the bench
client's start-up (imports, tokenizer, prompt sampling) in the idle seconds
before its first request, and back to 2 a second later
(benchmarks/serve_cpu_per_token.py: "other processes 0.00 cores" over the
run, yet "CPU threads 2 -> 1", "1 -> 2").
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


class CpuThreadGovernor:
    """Sets torch's thread count to the CPUs other processes leave free (see the module docstring).

    Args:
        max_threads: the configured thread count (never exceeded).
        interval_s: seconds between estimates.
    """

    def __init__(self, max_threads: int, interval_s: float = 1.0) -> None:
        self.max_threads = max(1, max_threads)
        self.interval_s = interval_s
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        self.threads = self.max_threads
        self._last = (time.monotonic(), _busy_seconds(self.cpus), _own_seconds())
        self._last_call = self._last[0]  # monotonic time of the previous step()

    def step(self) -> int:
        """Re-estimate at most once per interval; returns the thread count in force."""
        now = time.monotonic()
        last_call, self._last_call = self._last_call, now
        last_time, last_busy, last_own = self._last
        if now - last_time < self.interval_s or last_busy is None:
            return self.threads
        busy, own = _busy_seconds(self.cpus), _own_seconds()
        self._last = (now, busy, own)
        if busy is None:
            return self.threads
        if now - last_call > self.interval_s and (own - last_own) / (now - last_time) < 0.5:
            return self.threads  # the engine was idle through most of the window (see the module docstring)
        others = max(0.0, ((busy - last_busy) - (own - last_own)) / (now - last_time))  # cores, averaged
        target = min(self.max_threads, max(1, round(len(self.cpus) - others)))
        if target != self.threads:
            logger.info("CPU threads %d -> %d: other processes kept %.1f of %d CPUs busy (TOKENMILL_CPU_ADAPTIVE_"
                        "THREADS=0 keeps %d)", self.threads, target, others, len(self.cpus), self.max_threads)
            torch.set_num_threads(target)
            self.threads = target
        return self.threads
