"""One intra-op torch thread for tests of tiny models (the helpers' shared CPU cores)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run the block with torch.set_num_threads(1), restoring the previous count after.

    Tiny tensors: intra-op threads cost more than they save, and on the shared 2-core machine a step with one
    thread is ~10x faster than with two fighting for the cores. Every run a test compares uses the same count,
    so comparisons stay exact.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
