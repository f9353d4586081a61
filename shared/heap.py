"""The garbage collector of a long-running process. What a gateway or worker allocates while it starts (modules,
settings, tokenizers, model weights' Python objects) lives as long as the process, yet every full collection
scans it again: measured in a gateway under load, 25 ms a full collection, about one a second, each one a pause
of every request in flight. Frozen after start-up (`gc.freeze`), those objects are left out of collections; what
requests allocate is collected as before. `thaw_heap` undoes it when the component stops: a process that runs
several in turn (the test suite does) would otherwise never free a stopped one's objects held in cycles (a
worker's KV cache among them)."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then move every surviving object to the permanent generation: later collections scan only what
    was allocated since. Call once start-up is done; returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw_heap() -> None:
    """The component that froze the heap has stopped: its objects are collectable again."""
    gc.unfreeze()
