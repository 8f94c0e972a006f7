"""Smoke run of benchmarks/host_overhead.py (it patches engine internals, so it must keep up with them)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def test_host_overhead_smoke(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    import host_overhead

    threads = torch.get_num_threads()
    try:
        host_overhead.main(["--batch", "4", "--min-prompt", "20", "--max-prompt", "40", "--max-tokens", "6",
                            "--repeats", "2", "--vocab-size", "64"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = dict(line.strip("|").split("|")[:2] for line in out.splitlines() if line.startswith("| ") and "---" not in line)
    assert {k.strip() for k in rows} >= {"schedule", "update", "outputs", "block_table", "component"}
    assert "host total" in out
