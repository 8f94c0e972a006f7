"""Fixtures for the prefix-caching tests: one torch thread (helpers are in pc_helpers.py).

The machine these tests run on is shared (2 cores, often many processes);
with one intra-op thread a SmolLM2 step is ~10x faster there than with two
threads fighting for the cores. Every run a test compares uses the same
count, so comparisons stay exact.
"""

from __future__ import annotations

import pytest
from torch_threads import one_torch_thread

pytest.importorskip("torch")


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    with one_torch_thread():
        yield

