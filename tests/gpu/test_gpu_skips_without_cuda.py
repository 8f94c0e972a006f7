"""Every other test module in tests/gpu skips cleanly when no CUDA device is visible.

Runs pytest on the folder with no CUDA device visible: collection must not
fail, nothing may pass or fail, and each module must report its skips. Where
this process sees no CUDA device (the CPU CI) that run is a second pytest
session inside this process (the modules' imports are already loaded, ~2 s
instead of a ~20 s subprocess); where it sees one, a subprocess with
CUDA_VISIBLE_DEVICES="" (so it also holds on a GPU machine). This module
itself runs everywhere (it needs no GPU).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # a pytest subprocess that imports torch and transformers (on a GPU machine)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


class _Outcomes:
    """A pytest plugin that records the module (file name) and outcome of every collection and test report."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []  # (module, what, outcome)

    def pytest_collectreport(self, report) -> None:
        if report.nodeid.endswith(".py") or report.failed:
            self.seen.append((Path(report.nodeid.split("::")[0]).name, "collect", report.outcome))

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.seen.append((Path(report.nodeid.split("::")[0]).name, report.when, report.outcome))


def _modules() -> list[str]:
    modules = sorted(p.name for p in HERE.glob("test_*.py") if p.name != Path(__file__).name)
    assert modules
    return modules


def _in_process(tmp_path: Path) -> None:
    """The folder in a second pytest session in this process (which sees no CUDA device)."""
    outcomes = _Outcomes()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--capture=no", f"--rootdir={ROOT}",
                        f"--basetemp={tmp_path / 'inner'}", f"--ignore={__file__}", str(HERE)], plugins=[outcomes])
    assert code == pytest.ExitCode.OK, (code, outcomes.seen)
    bad = [s for s in outcomes.seen if s[2] == "failed" or s[1] == "call"]
    assert not bad, bad  # no collection error, no failure, no test that ran
    assert {m for m, _, outcome in outcomes.seen if outcome == "skipped"} == set(_modules()), outcomes.seen


def _in_subprocess() -> None:
    """The folder in a pytest subprocess with CUDA_VISIBLE_DEVICES=""."""
    modules = _modules()
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


def test_gpu_modules_skip_without_cuda(tmp_path):
    if torch.cuda.is_available():
        _in_subprocess()
    else:
        _in_process(tmp_path)
