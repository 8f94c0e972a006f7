"""The periodic engine stats line of the server log (off with --disable-log-stats), as vLLM's LoggingStatLogger.

Every `interval_s` seconds while requests run or wait, one line:
running / waiting requests, KV-cache use, prefix-cache hit rate and steps since
the last line. An idle server logs nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from tokenmill.engine.messages import SchedulerStats

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_S = 10.0  # vLLM's default interval (VLLM_LOG_STATS_INTERVAL)


def stats_line(stats: SchedulerStats | None, prev: SchedulerStats | None) -> str | None:
    """The line for `stats` (the latest) against `prev` (the last logged), or None when nothing ran since."""
    if stats is None:
        return None
    steps = stats.num_steps - (prev.num_steps if prev is not None else 0)
    if steps == 0 and stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0:
        return None
    queries = stats.prefix_cache_queries - (prev.prefix_cache_queries if prev is not None else 0)
    hits = stats.prefix_cache_hits - (prev.prefix_cache_hits if prev is not None else 0)
    hit_rate = 100.0 * hits / queries if queries else 0.0
    return (f"Engine: {stats.num_running_reqs} running, {stats.num_waiting_reqs} waiting, "
            f"KV cache {100.0 * stats.kv_cache_usage:.1f}% used, prefix cache hit rate {hit_rate:.1f}%, "
            f"{steps} steps since the last line")


async def log_stats_periodically(engine: Any, interval_s: float = LOG_STATS_INTERVAL_S) -> None:
    """Log `stats_line` every `interval_s` seconds until cancelled; `engine.get_scheduler_stats()` feeds it."""
    prev = None
    while True:
        await asyncio.sleep(interval_s)
        stats = engine.get_scheduler_stats()
        line = stats_line(stats, prev)
        if line is not None:
            logger.info("%s", line)
            prev = stats
