"""gc_heap_frozen: objects alive on entry skip GC passes inside, and are collectable again after."""

from __future__ import annotations

import gc
import weakref

from tokenmill.engine.gc_heap import gc_heap_frozen


class _Node:
    pass


def test_frozen_inside_unfrozen_after_and_cycles_collected_later():
    gc.unfreeze()
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a garbage cycle once the names go
    ref = weakref.ref(a)
    with gc_heap_frozen():
        assert gc.get_freeze_count() > 0
        del a, b
        gc.collect()
        assert ref() is not None  # frozen: the collector skips it
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_an_existing_freeze_is_left_in_place():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with gc_heap_frozen():
            pass
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()
