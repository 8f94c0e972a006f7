"""Every other test module in tests/gpu skips cleanly when no CUDA device is visible.

Runs pytest on the folder in a subprocess with CUDA_VISIBLE_DEVICES="" (so it
also holds on a GPU machine): collection must not fail, nothing may pass or
fail, and each module must report its skips. This module itself runs
everywhere (it needs no GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a pytest subprocess that imports torch and transformers

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def test_gpu_modules_skip_without_cuda():
    modules = sorted(p.name for p in HERE.glob("test_*.py") if p.name != Path(__file__).name)
    assert modules
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--ignore={__file__}", str(HERE)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert "skipped" in summary and not re.search(r"passed|failed|error", summary), summary
    skipped_modules = set(re.findall(r"SKIPPED \[\d+\] (?:\S*/)?(test_\w+\.py)", out))
    assert skipped_modules == set(modules), out
