"""Test doubles without Redis or torch: a request factory, a manual clock, and a fake compute side that
keeps to the interface the worker uses of `gpu_worker.engines.ModelEngines`."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from gpu_worker.outcomes import Ack, Emitted, HandBack, Outcome, failed_outcome, result_for
from shared.config import ModelSpec
from shared.messages import InferenceRequest, LaneStats
from shared.states import FinishReason, Priority, Status, Task


def make_request(rid: str, *, model: str = "m", lane: str = "short", timeout_s: float = 60.0,
                 input_ids: list[int] | None = None) -> InferenceRequest:
    now_ms = int(time.time() * 1000)
    return InferenceRequest(id=rid, tenant="t", model=model, task=Task.GENERATE, input={"input_ids": input_ids or [1]},
                            params={"max_new_tokens": 4}, lane=lane, priority=Priority.INTERACTIVE, created_ms=now_ms,
                            deadline_ms=now_ms + int(timeout_s * 1000), est_tokens=5)


@dataclass
class ManualClock:
    t: float = 1_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@dataclass
class FakeEngines:
    """One model's compute side on a thread of its own, as the real one: each submitted request passes
    the start gate, then finishes `succeeded` at once, or (if `hold` says so) runs until cancelled,
    drained or `finish()`ed. `fail` says which requests the model raises for."""

    spec: ModelSpec
    mark_running: Callable[[list[InferenceRequest]], list[bool] | None]
    emit: Callable[[list[Emitted]], None]
    hold: Callable[[InferenceRequest], bool] = lambda r: False
    fail: Callable[[InferenceRequest], bool] = lambda r: False
    running: dict[str, InferenceRequest] = field(default_factory=dict)
    computed: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    drained_until: float | None = None
    _inbox: queue.SimpleQueue[tuple[str, Any]] = field(default_factory=queue.SimpleQueue)
    _thread: threading.Thread | None = None

    # --- the interface the worker uses ---------------------------------------------------------------
    def submit(self, requests: list[InferenceRequest], now: float) -> None:
        if requests:
            self._inbox.put(("add", list(requests)))

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    def drain(self, until: float) -> None:
        self._inbox.put(("drain", until))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"fake-{self.spec.name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self._thread is None or not self._thread.is_alive()

    @property
    def crashed(self) -> list[str]:
        return []

    def lane_stats(self, worker: str) -> dict[str, LaneStats]:
        return {}

    def stats_fields(self, worker: str) -> list[str]:
        return [worker]

    def __iter__(self) -> Iterator[Any]:
        return iter(())  # no compute loops: nothing for `gpu_worker.rebalance` to hand back

    # --- for tests -------------------------------------------------------------------------------------
    def finish(self, request_id: str) -> None:
        self._inbox.put(("finish", request_id))

    # --- the compute thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with contextlib.suppress(queue.Empty):
                kind, arg = self._inbox.get(timeout=0.002)
                getattr(self, f"_{kind}")(arg)
            if self.drained_until is not None and (not self.running or time.time() >= self.drained_until):
                if self.running:  # the drain budget is spent: what still runs goes back
                    self.emit([HandBack(list(self.running.values()))])
                    self.running.clear()
                return

    def _add(self, requests: list[InferenceRequest]) -> None:
        if self.drained_until is not None:
            self.emit([HandBack(requests)])
            return
        live = self.mark_running(requests)
        if live is None:  # cannot tell: a real engine retries shortly; the fake gives the work back
            self.emit([HandBack(requests)])
            return
        out: list[Emitted] = [Ack(r) for r, ok in zip(requests, live, strict=True) if not ok]
        for r in (r for r, ok in zip(requests, live, strict=True) if ok):
            self.computed.append(r.id)
            if self.fail(r):
                out.append(failed_outcome(r, "fake", time.time(), "model_error", "the fake model raised", True))
            elif self.hold(r):
                self.running[r.id] = r
            else:
                out.append(self._succeeded(r))
        if out:
            self.emit(out)

    def _finish(self, request_id: str) -> None:
        r = self.running.pop(request_id, None)
        if r is not None:
            self.emit([self._succeeded(r)])

    def _cancel(self, request_id: str) -> None:
        r = self.running.pop(request_id, None)
        if r is not None:
            self.cancelled.append(request_id)
            self.emit([Ack(r)])

    def _drain(self, until: float) -> None:
        self.drained_until = until

    def _succeeded(self, r: InferenceRequest) -> Outcome:
        return Outcome(r, result_for(r, Status.SUCCEEDED, worker="fake", now=time.time(),
                                     output={"text": f"done {r.id}"}, reason=FinishReason.LENGTH))


def fake_engines_factory(made: dict[str, FakeEngines], **options: Any) -> Callable[..., Any]:
    """An `engines_factory` for `Worker`: FakeEngines per configured model, recorded in `made`; `load_s`: the models
    take this long to load."""
    load_s = options.pop("load_s", 0.0)

    async def factory(settings: Any, *, mark_running: Any, emit: Any, **_: Any) -> dict[str, FakeEngines]:
        await asyncio.sleep(load_s)
        for spec in settings.models:
            made[spec.name] = FakeEngines(spec, mark_running, emit, **options)
        return dict(made)

    return factory


async def not_ready_within(task: asyncio.Task[Any], ready: asyncio.Event, seconds: float) -> None:
    """A part waiting for its Redis neither became ready nor ended within `seconds` (waited on its events, not
    slept)."""
    readied = asyncio.ensure_future(ready.wait())
    done, _ = await asyncio.wait([task, readied], timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    readied.cancel()
    if task in done:
        task.result()  # its error, if it raised one
    assert not done, "it was meant to be waiting still"


async def stops_while_waiting(task: asyncio.Task[Any], stop: asyncio.Event, ready: asyncio.Event) -> None:
    """Stopped while it waits for its Redis: it ends, never ready."""
    await not_ready_within(task, ready, 0.2)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert not ready.is_set()
