"""The CPU KV cache default follows the memory still available (MemAvailable, or the cgroup limit when tighter)."""

from __future__ import annotations

import logging

import pytest

from tokenmill.platforms.memory import (
    CPU_KV_CAP_BYTES,
    CPU_KV_FALLBACK_BYTES,
    CPU_KV_FRACTION,
    cgroup_available_bytes,
    default_cpu_kv_cache_bytes,
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
