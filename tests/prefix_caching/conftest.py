"""Fixtures for the prefix-caching tests: one torch thread (helpers are in pc_helpers.py).

The machine these tests run on is shared (2 cores, often many processes);
with one intra-op thread a SmolLM2 step is ~10x faster there than with two
threads fighting for the cores. Every run a test compares uses the same
count, so comparisons stay exact.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

