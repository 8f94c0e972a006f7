"""The CPU platform."""

from __future__ import annotations

import ctypes
import sys

import torch

from tokenmill import envs
from tokenmill.platforms.interface import Platform


class CpuPlatform(Platform):
    device_type = "cpu"

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def default_dtype(self) -> torch.dtype:
        # float32, not bf16: the bundled 135M model (Q4_1 weights) drifts from
        # its float32 reference answer in bf16 within a few tokens; small models
        # have no precision to spare. bf16 is the faster choice where the CPU
        # has AMX / AVX512-BF16 (SmolLM2 served at concurrency 64 on the 2-core
        # dev box: 271 vs 162 output tok/s, docs/benchmarks.md), so it is one flag away.
        return torch.float32

    def default_dtype_reason(self) -> str:
        return ("float32 on CPU: bfloat16 changes small models' answers "
                "(--dtype bfloat16 is faster on CPUs with AMX or AVX512-BF16)")


# glibc mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def tune_malloc(trim_threshold: int = 1 << 30, top_pad: int = 64 << 20, mmap_threshold: int = 32 << 20) -> bool:
    """Let glibc keep freed activation memory for the next step instead of returning it to the OS.

    A CPU forward allocates and frees tensors of several MiB per op; with
    glibc's defaults, blocks above its (dynamic) mmap threshold are mmapped
    and unmapped each time and free heap above the trim threshold is handed
    back, so every step faults its activations in again, page by page
    (offline_throughput prefill, SmolLM2 fp32, one thread: 1.2-1.8 million
    minor faults and 2.3-4.7 s of system time, about 10% of the prefill's CPU
    time; with these settings 30-60 thousand faults, 0.1 s). Arguments, in
    bytes: `trim_threshold` (free heap kept before trimming),
    `top_pad` (extra heap asked for per extension), `mmap_threshold`
    (allocations at or above it are mmapped; 32 MiB is glibc's maximum).
    The cost is up to `trim_threshold` of freed memory the process keeps.

    Process-wide and glibc-only: returns False (changing nothing) on other C
    libraries, or when TOKENMILL_CPU_MALLOC_TUNING=0; True once applied.
    """
    if not envs.cpu_malloc_tuning() or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (e.g. musl): nothing to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = True
    for param, value in ((_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold),
                         (_M_TOP_PAD, top_pad)):
        ok &= mallopt(param, value) == 1  # mallopt returns 1 on success
    return ok
