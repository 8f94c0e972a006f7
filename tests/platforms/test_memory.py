"""The CPU KV cache default follows the memory still available (MemAvailable, or the cgroup limit when tighter);
an oversized cache is refused at start; its zeros are committed lazily (`lazy_zeros`)."""

from __future__ import annotations

import gc
import logging
import mmap
import sys

import pytest
import torch

from tokenmill.platforms.memory import (
    CPU_KV_CAP_BYTES,
    CPU_KV_FALLBACK_BYTES,
    CPU_KV_FRACTION,
    cgroup_available_bytes,
    CPU_KV_MAX_FRACTION,
    check_cpu_kv_cache_fits,
    default_cpu_kv_cache_bytes,
    host_available_bytes,
    lazy_zeros,
    mem_available_bytes,
)

GiB = 2**30


def _root(tmp_path, mem_available_kb=None, cgroup_v2=None, cgroup_v1=None):
    """A fake / with /proc/meminfo and cgroup files: cgroup_v* = (limit text, usage bytes)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    if mem_available_kb is not None:
        (tmp_path / "proc").mkdir()
        (tmp_path / "proc/meminfo").write_text(f"MemTotal:       99999999 kB\nMemFree:  1 kB\n"
                                               f"MemAvailable:   {mem_available_kb} kB\n")
    cg = tmp_path / "sys/fs/cgroup"
    if cgroup_v2 is not None:
        cg.mkdir(parents=True, exist_ok=True)
        (cg / "memory.max").write_text(f"{cgroup_v2[0]}\n")
        (cg / "memory.current").write_text(f"{cgroup_v2[1]}\n")
    if cgroup_v1 is not None:
        (cg / "memory").mkdir(parents=True, exist_ok=True)
        (cg / "memory/memory.limit_in_bytes").write_text(f"{cgroup_v1[0]}\n")
        (cg / "memory/memory.usage_in_bytes").write_text(f"{cgroup_v1[1]}\n")
    return str(tmp_path)


@pytest.mark.parametrize("free_gib", [2, 10, 24])
def test_the_default_is_a_fraction_of_mem_available(tmp_path, free_gib):
    root = _root(tmp_path, mem_available_kb=free_gib * 2**20)
    assert mem_available_bytes(root) == free_gib * GiB
    assert default_cpu_kv_cache_bytes(root) == int(CPU_KV_FRACTION * free_gib * GiB)


def test_less_free_memory_gives_a_smaller_cache(tmp_path):
    # The second instance on a 24 GiB machine sees what the first left.
    first = default_cpu_kv_cache_bytes(_root(tmp_path / "a", mem_available_kb=20 * 2**20))
    second = default_cpu_kv_cache_bytes(_root(tmp_path / "b", mem_available_kb=8 * 2**20))
    assert second < first and second == int(CPU_KV_FRACTION * 8 * GiB)


def test_a_tighter_cgroup_limit_wins_v2_and_v1(tmp_path):
    v2 = _root(tmp_path / "v2", mem_available_kb=64 * 2**20, cgroup_v2=(6 * GiB, 1 * GiB))
    assert cgroup_available_bytes(v2) == 5 * GiB
    assert default_cpu_kv_cache_bytes(v2) == int(CPU_KV_FRACTION * 5 * GiB)
    v1 = _root(tmp_path / "v1", mem_available_kb=64 * 2**20, cgroup_v1=(3 * GiB, 0))
    assert default_cpu_kv_cache_bytes(v1) == int(CPU_KV_FRACTION * 3 * GiB)


def test_an_unlimited_cgroup_is_ignored(tmp_path):
    root = _root(tmp_path, mem_available_kb=10 * 2**20, cgroup_v2=("max", 5 * GiB),
                 cgroup_v1=(2**63 - 4096, 5 * GiB))
    assert cgroup_available_bytes(root) is None
    assert default_cpu_kv_cache_bytes(root) == int(CPU_KV_FRACTION * 10 * GiB)


def test_the_default_is_capped_and_has_a_fallback(tmp_path):
    assert default_cpu_kv_cache_bytes(_root(tmp_path / "big", mem_available_kb=1000 * 2**20)) == CPU_KV_CAP_BYTES
    assert default_cpu_kv_cache_bytes(_root(tmp_path / "none")) == CPU_KV_FALLBACK_BYTES


def test_the_choice_is_logged(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.platforms.memory"):
        default_cpu_kv_cache_bytes(_root(tmp_path, mem_available_kb=10 * 2**20, cgroup_v2=(4 * GiB, 0)))
    assert "KV cache: 1.60 GiB = 0.4 x 4.00 GiB available (the cgroup memory limit)" in caplog.text


def test_an_explicit_size_wins_and_cpu_leaves_the_default_to_the_worker():
    from types import SimpleNamespace

    from tokenmill.config.resolve import _resolve_cache_config

    args = SimpleNamespace(kv_cache_memory_bytes=None, block_size=16, num_gpu_blocks_override=None,
                           gpu_memory_utilization=0.9, enable_prefix_caching=True, kv_cache_dtype="auto")
    cpu = SimpleNamespace(device_type="cpu")
    assert _resolve_cache_config(args, cpu).kv_cache_memory_bytes is None
    args.kv_cache_memory_bytes = "256M"
    assert _resolve_cache_config(args, cpu).kv_cache_memory_bytes == 256 * 2**20


def test_host_available_bytes_names_the_tighter_source(tmp_path):
    assert host_available_bytes(_root(tmp_path / "host", mem_available_kb=10 * 2**20)) == (10 * GiB, "MemAvailable")
    tight = _root(tmp_path / "cg", mem_available_kb=10 * 2**20, cgroup_v2=(4 * GiB, GiB))
    assert host_available_bytes(tight) == (3 * GiB, "the cgroup memory limit")
    assert host_available_bytes(_root(tmp_path / "none")) is None


def test_kv_cache_larger_than_available_memory_is_refused_with_the_flag():
    check_cpu_kv_cache_fits(9 * GiB, (10 * GiB, "MemAvailable"))  # CPU_KV_MAX_FRACTION (0.9) of it fits
    check_cpu_kv_cache_fits(10**15, None)  # unknown memory: nothing to check against
    with pytest.raises(ValueError) as info:
        check_cpu_kv_cache_fits(9 * GiB + 1, (10 * GiB, "the cgroup memory limit"))
    msg = str(info.value)
    assert f"needs {9 * GiB + 1} bytes (9.00 GiB) but only {10 * GiB} bytes (10.00 GiB) of memory are available " \
           "(the cgroup memory limit)" in msg, msg
    assert CPU_KV_MAX_FRACTION == 0.9 and "--kv-cache-memory-bytes" in msg


def test_default_kv_cache_is_shared_by_the_workers_of_the_host(tmp_path):
    """Tensor x pipeline parallel workers on one host each take 1 / workers of the default, so together they
    stay at CPU_KV_FRACTION of the available memory (and pass the start-up check)."""
    root = _root(tmp_path, mem_available_kb=10 * 2**20)
    one = default_cpu_kv_cache_bytes(root)
    assert default_cpu_kv_cache_bytes(root, num_workers=4) == one // 4
    check_cpu_kv_cache_fits(4 * (one // 4), host_available_bytes(root))


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_lazy_zeros_is_a_zeroed_writable_page_aligned_tensor(dtype):
    shape = (2, 3, 16, 2, 8)
    t = lazy_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    bits = t.view(torch.uint8)
    assert int(bits.count_nonzero()) == 0
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % mmap.PAGESIZE == 0  # an mmap, not torch's allocator
    bits[1, 2].fill_(0x3C)  # block 2 of the values, through the raw bytes (any dtype)
    changed = bits.reshape(2, 3, -1).ne(0).all(dim=2)
    assert changed.tolist() == [[False, False, False], [False, False, True]]


def test_lazy_zeros_memory_lives_as_long_as_the_tensor():
    t = lazy_zeros((1024, 1024), torch.float32)[7]  # a view: the base tensor and its name are gone
    gc.collect()
    t.fill_(2.0)
    assert float(t.sum()) == 2.0 * 1024


def test_lazy_zeros_falls_back_to_torch_zeros_off_linux(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("mmap used off Linux")

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(mmap, "mmap", never)
    t = lazy_zeros((4, 5), torch.bfloat16)
    assert t.shape == (4, 5) and t.dtype == torch.bfloat16 and int(t.count_nonzero()) == 0
    t[1, 2] = 1.0
    assert int(t.count_nonzero()) == 1


def test_lazy_zeros_falls_back_when_mmap_refuses(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    t = lazy_zeros((3, 4), torch.float16)
    assert t.shape == (3, 4) and t.dtype == torch.float16 and int(t.count_nonzero()) == 0
