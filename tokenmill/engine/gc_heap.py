"""Keep long-lived objects out of Python's cyclic GC while the engine steps.

Start-up leaves a few hundred thousand long-lived objects (torch and model
modules, the engine itself). Each full collection of the cyclic GC walks all
of them (0.1-0.4 s), and a decode loop that allocates a few thousand small
objects per step triggers one every few hundred steps: a stalled step.
`gc.freeze()` moves every object alive at that moment to a permanent
generation that collections skip; reference counting still frees them.
(vLLM's engine core freezes its start-up heap the same way.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_gc_heap() -> None:
    """Collect once, then freeze every live object for the rest of the process.

    For a process that serves one engine until it exits (the server's engine
    core, and the API server once its app is built). The collection first makes sure no garbage cycle (which could hold
    tensors) is frozen for good.
    """
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def gc_heap_frozen() -> Iterator[None]:
    """Freeze the objects alive on entry until exit (one offline `generate` run).

    On exit they go back to the collected generations, so an engine dropped
    later is still collected. If something was already frozen on entry (the
    caller's own `gc.freeze()`), nothing is unfrozen on exit.
    """
    was_frozen = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not was_frozen:
            gc.unfreeze()
