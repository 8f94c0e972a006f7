"""Markers and paths for the deployment tests (images, manifests, Prometheus)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# server_harness lives beside the e2e tests.
sys.path.insert(0, str(REPO / "tests" / "e2e"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes minutes (a server, a container build, Prometheus)")
    config.addinivalue_line("markers", "e2e: runs a real tokenmill server")
