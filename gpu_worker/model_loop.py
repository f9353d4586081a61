"""The per-model compute loop, on its own thread so torch never blocks the worker's asyncio I/O.

Commands arrive on a thread-safe inbox (requests read from Redis, cancellations, drain); outcomes
leave through `emit`. The loop reads as the data flow:

    receive commands -> plan (pure scheduler) -> gate (Redis: still live?) -> prefill/decode -> emit

Invariant: a request reaches the model only if, just before its prefill, its deadline has not
passed and its record is not terminal (cancelled requests are never computed); a running row is
checked for cancellation and its deadline at every decode step.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gpu_worker import metrics
from gpu_worker.engine import EngineStats
from gpu_worker.runners import Outcome, Runner, expired_outcome
from gpu_worker.scheduler import Pending, Scheduler
from shared.messages import InferenceRequest

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 1.0
METRICS_INTERVAL_S = 1.0


@dataclass(slots=True)
class Add:
    requests: list[InferenceRequest]
    arrived: float


@dataclass(slots=True)
class Cancel:
    ids: set[str]


@dataclass(slots=True)
class Drain:
    """Stop starting new work; finish running rows until `until`, then hand back the rest."""

    until: float


@dataclass(slots=True)
class Ack:
    """Nothing to write (the record is already terminal): just acknowledge the stream entry."""

    request: InferenceRequest


@dataclass(slots=True)
class HandBack:
    """Work this worker will not do after all: put it back for another worker."""

    requests: list[InferenceRequest]


@dataclass(slots=True)
class LoopState:
    backlog: dict[str, int] = field(default_factory=dict)
    running: int = 0
    stopped: bool = False


Emitted = Outcome | Ack | HandBack


class ModelLoop:
    def __init__(self, name: str, runner: Runner, scheduler: Scheduler, *,
                 gate: Callable[[list[InferenceRequest]], list[bool]],
                 emit: Callable[[list[Emitted]], None], on_crash: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time, worker: str = "") -> None:
        self.name = name
        self.runner = runner
        self.scheduler = scheduler
        self._gate = gate
        self._emit = emit
        self._on_crash = on_crash
        self._clock = clock
        self._worker = worker
        self._inbox: queue.SimpleQueue[Add | Cancel | Drain] = queue.SimpleQueue()
        self._drain_until: float | None = None
        self._thread: threading.Thread | None = None
        self.state = LoopState()
        self.crashed: BaseException | None = None
        self._last_metrics = time.monotonic()
        self._last_stats = EngineStats()

    # --- called from the asyncio side ----------------------------------------------------------
    def submit(self, cmd: Add | Cancel | Drain) -> None:
        self._inbox.put(cmd)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"model-loop-{self.name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def buffered(self) -> int:
        return sum(self.state.backlog.values()) + self.state.running

    # --- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self.state.stopped:
                self._iterate()
        except BaseException as exc:  # the worker notices and exits non-zero; entries get reclaimed
            self.crashed = exc
            log.exception("model loop crashed", model=self.name)
            self._on_crash()
        finally:
            self.state.stopped = True

    def _iterate(self) -> None:
        self._receive(block=False, timeout=0)
        now = self._clock()
        out: list[Emitted] = list(self.runner.expire(now))
        draining = self._drain_until is not None
        plan = self.scheduler.plan(now, 0 if draining else self.runner.free_rows)
        out.extend(expired_outcome(p.payload[0], self._worker, now, "while queued at the worker")
                   for p in plan.expired)
        if plan.batch:
            out.extend(self._start(plan.batch, now))
        if self.runner.busy:
            out.extend(self.runner.step())
        self._publish_state()
        if out:
            self._emit(out)
        if draining and (not self.runner.busy or self._clock() >= (self._drain_until or 0)):
            self._hand_back()
            return
        if not plan.batch and not self.runner.busy:
            wait = IDLE_WAIT_S if plan.wake_at is None else max(0.0, min(IDLE_WAIT_S, plan.wake_at - now))
            self._receive(block=True, timeout=wait)

    def _start(self, batch: list[Pending], now: float) -> list[Emitted]:
        reqs = [p.payload[0] for p in batch]
        live = self._gate(reqs)
        out: list[Emitted] = [Ack(r) for r, ok in zip(reqs, live, strict=True) if not ok]
        batch = [p for p, ok in zip(batch, live, strict=True) if ok]
        # the gate took a round trip: re-check deadlines right before the model sees the batch
        now = self._clock()
        keep = [p for p in batch if p.deadline > now]
        out.extend(expired_outcome(p.payload[0], self._worker, now, "before prefill")
                   for p in batch if p.deadline <= now)
        if keep:
            metrics.BATCH_SIZE.labels(self.name, keep[0].lane).observe(sum(p.size for p in keep))
            for p in keep:
                metrics.QUEUE_WAIT.labels(self.name, p.lane).observe(max(0.0, now - p.payload[0].created_ms / 1000))
            out.extend(self.runner.start(keep, now))
        return out

    def _receive(self, *, block: bool, timeout: float) -> None:
        try:
            cmd = self._inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: Add | Cancel | Drain) -> None:
        if isinstance(cmd, Add):
            out: list[Emitted] = []
            for req in cmd.requests:
                item = self.runner.prepare(req, cmd.arrived)
                if isinstance(item, Pending):
                    self.scheduler.add(item)
                else:
                    out.append(item)
            if out:
                self._emit(out)
        elif isinstance(cmd, Cancel):
            acks: list[Emitted] = []
            for rid in cmd.ids:
                item = self.scheduler.cancel(rid)
                if item is not None:
                    acks.append(Ack(item.payload[0]))
            acks.extend(self.runner.cancel(cmd.ids))
            if acks:
                self._emit(acks)
        else:
            self._drain_until = cmd.until

    def _hand_back(self) -> None:
        waiting = [p.payload[0] for p in self.scheduler.drain()]
        running = self.runner.cancel(set(self.runner.running_ids()))
        reqs = waiting + [o.request for o in running]
        self._emit([HandBack(reqs)])
        self.state.stopped = True

    def _publish_state(self) -> None:
        self.state.backlog = self.scheduler.backlog()
        self.state.running = len(self.runner.running_ids())
        now = time.monotonic()
        if now - self._last_metrics < METRICS_INTERVAL_S:
            return
        for lane, n in self.state.backlog.items():
            metrics.WORKER_BACKLOG.labels(self.name, lane).set(n)
        metrics.RUNNING.labels(self.name).set(self.state.running)
        stats = self.runner.engine_stats()
        if stats is not None:
            prev = self._last_stats
            dt = now - self._last_metrics
            metrics.TOKENS_PER_S.labels(self.name).set((stats.decode_tokens - prev.decode_tokens) / dt)
            metrics.PHASE_SECONDS.labels(self.name, "prefill").inc(stats.prefill_s - prev.prefill_s)
            metrics.PHASE_SECONDS.labels(self.name, "decode").inc(stats.decode_s - prev.decode_s)
            padded = stats.kv_padded - prev.kv_padded
            if padded:
                metrics.KV_PADDING.labels(self.name).set(1 - (stats.kv_real - prev.kv_real) / padded)
            self._last_stats = dataclasses.replace(stats)
        self._last_metrics = now
