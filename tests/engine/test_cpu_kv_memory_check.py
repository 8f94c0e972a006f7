"""A CPU KV cache larger than the memory available at start is refused at start-up, not under load.

The cache's pages are committed lazily (worker/kv_cache.py), so without the engine core's check
(`platforms.memory.check_cpu_kv_cache_fits`) an oversized --kv-cache-memory-bytes would start and be
OOM-killed later. Model: the shared tiny dummy-weight Llama (`tiny_dir`), float32, 4 KiB per 16-token block
over its 2 layers (2 KV heads of 8 dims).
"""

from __future__ import annotations

import math

import pytest

from tokenmill import LLM
from tokenmill.platforms import memory

BLOCK_BYTES = 16 * 2 * 2 * 2 * 8 * 4  # tokens x (K, V) x layers x kv heads x head dim x float32
KV_BYTES = 64 * BLOCK_BYTES


def _start(model_dir: str) -> LLM:
    return LLM(model=model_dir, load_format="dummy", device="cpu", dtype="float32", skip_tokenizer_init=True,
               block_size=16, kv_cache_memory_bytes=KV_BYTES, max_model_len=256, max_num_seqs=2)


FITS = math.ceil(KV_BYTES / memory.CPU_KV_MAX_FRACTION)  # the least available memory that holds the cache


def test_kv_cache_larger_than_available_memory_fails_at_start(tiny_dir, monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda root="/": (FITS - 1, "MemAvailable"))
    expected = rf"needs {KV_BYTES} bytes .* but only {FITS - 1} bytes .*--kv-cache-memory-bytes"
    with pytest.raises(ValueError, match=expected):
        _start(tiny_dir)


def test_the_check_after_loading_counts_what_the_weights_took(tiny_dir, monkeypatch):
    """Before loading the memory suffices; after it (the weights now resident) it does not: the second check,
    over every worker's blocks, refuses."""
    answers = iter([(10 * FITS, "MemAvailable"), (FITS - 1, "MemAvailable")])
    monkeypatch.setattr(memory, "host_available_bytes", lambda root="/": next(answers))
    with pytest.raises(ValueError, match=rf"needs {KV_BYTES} bytes .* but only {FITS - 1} bytes"):
        _start(tiny_dir)
    assert next(answers, None) is None  # both checks ran


def test_kv_cache_that_fits_starts(tiny_dir, monkeypatch):
    monkeypatch.setattr(memory, "host_available_bytes", lambda root="/": (FITS, "MemAvailable"))
    llm = _start(tiny_dir)
    assert llm.llm_engine.engine_config.cache_config.num_gpu_blocks == 64
    llm.llm_engine.shutdown()
