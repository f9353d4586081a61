"""`shared.heap.freeze_startup_heap`: what exists at the call leaves the collector's scans; what is allocated after
is collected as before."""

from __future__ import annotations

import gc
import weakref

from shared.heap import freeze_startup_heap, thaw_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_startup_objects_are_frozen_and_later_garbage_is_still_collected():
    before = cycle()  # garbage already: collected by the call's own collection, not frozen
    kept = Node()
    try:
        frozen = freeze_startup_heap()
        # A frozen object freed by reference counting (by another test's leftover thread, say) leaves the count:
        # it can fall after the call, never rise without another freeze.
        assert frozen >= gc.get_freeze_count() > 0
        assert before() is None
        assert gc.is_tracked(kept) and gc.get_freeze_count() <= frozen
        later = cycle()
        assert later() is not None
        gc.collect()
        assert later() is None  # allocated after the freeze: collected as before
    finally:
        gc.unfreeze()


def test_a_stopped_component_thaws_what_it_froze():
    """A process that runs components in turn (the test suite) must get a stopped one's cyclic objects back."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    kept = weakref.ref(a)
    try:
        freeze_startup_heap()  # alive now: frozen
        del a, b  # a stopped component's objects, held only by their own cycle
        gc.collect()
        assert kept() is not None  # frozen: never collected while frozen
    finally:
        thaw_heap()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert kept() is None
