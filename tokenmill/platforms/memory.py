"""Host memory for the CPU KV cache: how much this process may still use, the cache's default size and the
start-up check, and the lazily committed allocation (`lazy_zeros`).

Available memory is the smaller of:

    /proc/meminfo MemAvailable                      what the kernel can give without swapping
    cgroup limit - cgroup usage                     when the process runs under a memory limit
        v2: /sys/fs/cgroup/memory.max, memory.current ("max": no limit)
        v1: /sys/fs/cgroup/memory/memory.limit_in_bytes, memory.usage_in_bytes

The CPU KV cache default (no --kv-cache-memory-bytes) is measured after the
weights are loaded:

    kv bytes per worker = min(CPU_KV_FRACTION * available, CPU_KV_CAP_BYTES) / workers

(workers: the tensor x pipeline parallel ranks, all counted as on this host)

so a second server on the same machine sizes itself from what the first one
left (what it has written of its KV cache so far, see below), instead of both
taking a fixed 4 GiB and waking the OOM killer.

The CPU KV cache is allocated zero-filled but uncommitted (`lazy_zeros`: an
anonymous private mmap on Linux), so its pages become resident only as blocks
are first written. A cache larger than the memory available at start would
then fail under load instead of at start, so `check_cpu_kv_cache_fits`
refuses it at start-up: all workers' caches together may take at most
CPU_KV_MAX_FRACTION of the available memory (the rest is for activations).
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

CPU_KV_FRACTION = 0.4  # of the memory still available: activations, the tokenizer and the OS need the rest
CPU_KV_CAP_BYTES = 16 * 2**30
CPU_KV_MAX_FRACTION = 0.9  # the largest share of the available memory an explicit size may take
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


def host_available_bytes(root: str = "/") -> tuple[int, str] | None:
    """The memory this process may still use in bytes and where the figure comes from ("MemAvailable" or
    "the cgroup memory limit"): the smaller of the two (module docstring), or None when neither can be read."""
    host = mem_available_bytes(root)
    cgroup = cgroup_available_bytes(root)
    known = [x for x in (host, cgroup) if x is not None]
    if not known:
        return None
    available = min(known)
    return available, "the cgroup memory limit" if cgroup is not None and cgroup == available else "MemAvailable"


def check_cpu_kv_cache_fits(kv_bytes: int, available: tuple[int, str] | None) -> None:
    """Refuse a CPU KV cache of `kv_bytes` bytes (all workers of this host together) larger than
    CPU_KV_MAX_FRACTION of the memory `available` at start (`host_available_bytes`; None: unknown, nothing is
    checked).

    The cache's pages are committed lazily (`lazy_zeros`), so without this check an oversized cache would start
    and then be OOM-killed once enough blocks are written.

    Raises:
        ValueError: naming both sizes and --kv-cache-memory-bytes.
    """
    if available is None or kv_bytes <= CPU_KV_MAX_FRACTION * available[0]:
        return
    free, source = available
    raise ValueError(
        f"The CPU KV cache needs {kv_bytes} bytes ({kv_bytes / 2**30:.2f} GiB) but only {free} bytes "
        f"({free / 2**30:.2f} GiB) of memory are available ({source}), and at most {CPU_KV_MAX_FRACTION:g} of it "
        f"may hold the cache; pass a smaller --kv-cache-memory-bytes (it is per worker; or leave it unset: the "
        f"default takes {CPU_KV_FRACTION:g} x the available memory, shared by the workers).")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, contiguous, writable CPU tensor of `shape` and `dtype` whose memory is committed on first
    touch: on Linux an anonymous private mmap, which the kernel maps to its shared zero page until a page is
    written (mmap(2)), so a large KV cache costs no time and no resident memory at start. Elsewhere, or when
    mmap or `torch.frombuffer` refuses (no memory, a dtype it cannot view), `torch.zeros`.

    The data is page-aligned (stricter than torch's 64 bytes). `torch.frombuffer` holds a reference to the mmap,
    which is unmapped when the last tensor or view of it is freed.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0 or not sys.platform.startswith("linux"):
        return torch.zeros(shape, dtype=dtype)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                        prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        return torch.zeros(shape, dtype=dtype)
    try:
        return torch.frombuffer(buf, dtype=dtype).view(shape)
    except (TypeError, ValueError, RuntimeError):
        buf.close()
        return torch.zeros(shape, dtype=dtype)


def default_cpu_kv_cache_bytes(root: str = "/", num_workers: int = 1) -> int:
    """One worker's CPU KV cache size when --kv-cache-memory-bytes is not given, `num_workers` (>= 1) sharing
    this host (see module docstring); logs the choice."""
    known = host_available_bytes(root)
    if known is None:
        logger.info("KV cache: %.2f GiB (available memory unknown; set --kv-cache-memory-bytes to choose)",
                    CPU_KV_FALLBACK_BYTES / 2**30)
        return CPU_KV_FALLBACK_BYTES // num_workers
    available, source = known
    budget = min(int(CPU_KV_FRACTION * available), CPU_KV_CAP_BYTES)
    logger.info("KV cache: %.2f GiB = %g x %.2f GiB available (%s)%s%s; set --kv-cache-memory-bytes to choose",
                budget / 2**30, CPU_KV_FRACTION, available / 2**30, source,
                f", capped at {CPU_KV_CAP_BYTES / 2**30:g} GiB" if budget == CPU_KV_CAP_BYTES else "",
                f", shared by {num_workers} workers" if num_workers > 1 else "")
    return budget // num_workers
