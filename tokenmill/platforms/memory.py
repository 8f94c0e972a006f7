"""How much host memory this process may still use, and the CPU KV cache's default size from it.

Available memory is the smaller of:

    /proc/meminfo MemAvailable                      what the kernel can give without swapping
    cgroup limit - cgroup usage                     when the process runs under a memory limit
        v2: /sys/fs/cgroup/memory.max, memory.current ("max": no limit)
        v1: /sys/fs/cgroup/memory/memory.limit_in_bytes, memory.usage_in_bytes

The CPU KV cache default (no --kv-cache-memory-bytes) is measured after the
weights are loaded:

    kv bytes = min(CPU_KV_FRACTION * available, CPU_KV_CAP_BYTES)

so a second server on the same machine sizes itself from what the first one
left, instead of both taking a fixed 4 GiB and waking the OOM killer.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.4  # of the memory still available: activations, the tokenizer and the OS need the rest
CPU_KV_CAP_BYTES = 16 * 2**30
# Used when no memory figure can be read at all (not Linux): the old fixed default.
CPU_KV_FALLBACK_BYTES = 4 * 2**30
# A cgroup v1 "unlimited" limit is a page-rounded 2^63 - 1; anything this large is no limit.
_UNLIMITED = 2**60


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def mem_available_bytes(root: str = "/") -> int | None:
    """MemAvailable from `<root>/proc/meminfo` in bytes, or None when it cannot be read."""
    try:
        for line in (Path(root) / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cgroup_available_bytes(root: str = "/") -> int | None:
    """The cgroup memory limit minus current usage in bytes, or None when no limit applies."""
    cg = Path(root) / "sys/fs/cgroup"
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit = _read_int(cg / limit_file)
        if limit is None or limit >= _UNLIMITED:
            continue
        usage = _read_int(cg / usage_file) or 0
        return max(limit - usage, 0)
    return None


def default_cpu_kv_cache_bytes(root: str = "/") -> int:
    """The CPU KV cache size when --kv-cache-memory-bytes is not given (see module docstring); logs the choice."""
    host = mem_available_bytes(root)
    cgroup = cgroup_available_bytes(root)
    known = [x for x in (host, cgroup) if x is not None]
    if not known:
        logger.info("KV cache: %.2f GiB (available memory unknown; set --kv-cache-memory-bytes to choose)",
                    CPU_KV_FALLBACK_BYTES / 2**30)
        return CPU_KV_FALLBACK_BYTES
    available = min(known)
    source = "the cgroup memory limit" if cgroup is not None and cgroup == available else "MemAvailable"
    budget = min(int(CPU_KV_FRACTION * available), CPU_KV_CAP_BYTES)
    logger.info("KV cache: %.2f GiB = %g x %.2f GiB available (%s)%s; set --kv-cache-memory-bytes to choose",
                budget / 2**30, CPU_KV_FRACTION, available / 2**30, source,
                f", capped at {CPU_KV_CAP_BYTES / 2**30:g} GiB" if budget == CPU_KV_CAP_BYTES else "")
    return budget
