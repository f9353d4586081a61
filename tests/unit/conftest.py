"""The unit tier is pure: no Redis, no model, no torch. Under `make test-fast` the run fails if anything imported
torch (`tests/torch_guard.py`, whose hooks `tests/conftest.py` takes in)."""

from __future__ import annotations

import pytest


@pytest.fixture
def heap_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A worker started in this process freezes its start-up heap (`shared.heap`): a full collection of the test
    process's heap, a third of a second each time here, once per worker a test starts. The tests that start
    workers in-process record the calls instead; `shared.heap` itself is tested in test_heap.py, and
    test_worker.py checks that a worker freezes once loaded and thaws once stopped."""
    import gpu_worker.worker as worker_module

    calls: list[str] = []

    def freeze() -> int:
        calls.append("freeze")
        return 0

    monkeypatch.setattr(worker_module, "freeze_startup_heap", freeze)
    monkeypatch.setattr(worker_module, "thaw_heap", lambda: calls.append("thaw"))
    return calls
