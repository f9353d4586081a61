"""The per-model compute loop, on its own thread so torch never blocks the worker's asyncio I/O.

Commands arrive on a thread-safe inbox (requests read from Redis, cancellations, drain); outcomes
leave through `emit`. The loop reads as the data flow:

    receive commands -> plan (pure scheduler) -> gate (Redis: still live?) -> prefill/decode -> emit

Invariant: in deadline-aware mode a request reaches the model only if, just before its prefill,
its deadline has not passed and its record is not terminal (cancelled requests are never
computed); a running row is checked for cancellation and its deadline at every decode step.
The loop also measures the service-time model (prefill and decode cost) and keeps a snapshot of
its load that the worker publishes for the gateway's admission control.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from gpu_worker import metrics
from gpu_worker.engine import EngineStats
from gpu_worker.outcomes import Ack, Emitted, HandBack, Outcome, expired_outcome, failed_outcome
from gpu_worker.runners import Runner
from gpu_worker.scheduler import Pending, Scheduler
from gpu_worker.service_model import ServiceTracker, lane_wait_ms
from shared.faults import Faults
from shared.messages import InferenceRequest

if TYPE_CHECKING:
    from gpu_worker.turns import SharedComputeThread

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 1.0
METRICS_INTERVAL_S = 1.0
# A running row is given up only if even 80% of its estimated remaining time would end past its deadline.
DOOM_OPTIMISM = 0.8
GATE_RETRY_S = 0.5
GATE_NORMAL_S = 0.1
# Sharing a thread, a background engine's turn beside the first engine's running rows starts no prefill
# (a 256-token prompt's forward takes ~100 ms on the 2-core VM, and every short row would wait it out)
# unless work has waited this long; then it prefills one request.
BACKGROUND_PREFILL_WAIT_S = 0.5


@dataclass(slots=True)
class Add:
    requests: list[InferenceRequest]
    arrived: float


@dataclass(slots=True)
class Adopt:
    """Requests another engine of the same model read and prepared, whose real lane is one of this engine's."""

    items: list[Pending]


@dataclass(slots=True)
class Cancel:
    ids: set[str]


@dataclass(slots=True)
class Drain:
    """Stop starting new work; finish running rows until `until`, then hand back the rest."""

    until: float


@dataclass(frozen=True, slots=True)
class LaneLoad:
    waiting: int
    running: int
    completed_rps: float
    est_wait_ms: float


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The loop's load, replaced whole (never mutated) so other threads can read it safely."""

    at: float = 0.0
    lanes: dict[str, LaneLoad] = field(default_factory=dict)
    max_rows: int = 0
    free_rows: int = 0
    prefill_fixed_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    decode_ms_per_step: float = 0.0


class ModelLoop:
    def __init__(self, name: str, runner: Runner, scheduler: Scheduler, *,
                 gate: Callable[[list[InferenceRequest]], list[bool] | None],
                 emit: Callable[[list[Emitted]], None], on_crash: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time, worker: str = "", idle_wait_s: float = IDLE_WAIT_S,
                 faults: Faults | None = None, engine: str = "main",
                 hand_over: Callable[[list[Pending]], None] | None = None,
                 bind_thread: Callable[[], str] | None = None) -> None:
        self.name = name  # the model (metrics and logs are labelled by it)
        self.engine = engine
        self._hand_over = hand_over  # to the engine of a lane this one does not serve
        self._bind_thread = bind_thread
        # told, on this loop's thread, each iteration whether it has work (the worker shares CPU cores by it)
        self.on_work: Callable[[bool], None] | None = None
        self.runner = runner
        self.scheduler = scheduler
        self._gate = gate
        self._emit = emit
        self._on_crash = on_crash
        self._clock = clock
        self._worker = worker
        self._idle_wait_s = idle_wait_s
        self._faults = faults or Faults()
        self._inbox: queue.SimpleQueue[Add | Adopt | Cancel | Drain] = queue.SimpleQueue()
        self._drain_until: float | None = None
        self._thread: threading.Thread | None = None
        self._running: dict[str, Pending] = {}  # started, not finished
        self.tracker = ServiceTracker(tuple(scheduler.queues))
        self.max_rows = runner.free_rows
        self.snapshot = Snapshot()
        self.stopped = False
        self.crashed: BaseException | None = None
        self._last_metrics = time.monotonic()
        self._last_stats = EngineStats()
        self._last_step_end: float | None = None
        self._excluded_s = 0.0  # time spent waiting on Redis this iteration (not part of the token interval)
        self._gate_retry_at = 0.0
        self._host: SharedComputeThread | None = None  # set when this loop shares a thread with others
        self.yielding = False  # set by the host: a background turn while the first engine has rows running

    def attach(self, host: SharedComputeThread) -> None:
        """Run on `host`'s thread, taking turns with the other engines there, instead of a thread of its own."""
        self._host = host

    # --- called from the asyncio side ----------------------------------------------------------
    def submit(self, cmd: Add | Adopt | Cancel | Drain) -> None:
        self._inbox.put(cmd)
        if self._host is not None:
            self._host.wake()

    def emit(self, items: list[Emitted]) -> None:
        self._emit(items)

    def start(self) -> None:
        if self._host is not None:
            self._host.start()
            return
        self._thread = threading.Thread(target=self._run, name=f"model-loop-{self.name}-{self.engine}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        if self._host is not None:
            return self._host.join(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def has_work(self) -> bool:
        """Rows running, requests queued, or commands not yet received."""
        return self.runner.busy or len(self.scheduler) > 0 or not self._inbox.empty()

    @property
    def buffered(self) -> int:
        snap = self.snapshot
        return sum(ln.waiting + ln.running for ln in snap.lanes.values())

    # --- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self._bind_thread is not None:
                log.info("compute loop started", model=self.name, engine=self.engine, lanes=list(self.scheduler.queues),
                         rows=self.max_rows, thread=self._bind_thread())
            while not self.stopped:
                self._iterate()
        except BaseException as exc:  # the worker notices and exits non-zero; entries get reclaimed
            self.crashed = exc
            log.exception("model loop crashed", model=self.name)
            self._on_crash()
        finally:
            self.stopped = True

    def _iterate(self, block: bool = True) -> float | None:
        """One round: receive, plan, start, step. With nothing to compute it waits for a command (up to
        the scheduler's next wake-up) or, if not `block`, returns how long it could wait."""
        self._receive(block=False, timeout=0)
        if self.on_work is not None:
            self.on_work(self.runner.busy or len(self.scheduler) > 0)
        now = self._clock()
        out: list[Emitted] = list(self.runner.expire(now))
        # tokens left per running row, read once: doomed rows leave by it, and the rest bound the room
        left = self.runner.remaining_tokens() if self.scheduler.deadline_aware else {}
        if self.scheduler.deadline_aware:
            evicted = self._evict_doomed(now, left)
            for o in evicted:
                left.pop(o.request.id, None)
            out.extend(evicted)
        draining = self._drain_until is not None
        preemptible = [p for p in self._running.values() if p.rank > 0]
        holding = draining or now < self._gate_retry_at  # Redis could not confirm the last batch: hold off
        free = 0 if holding else self._free_rows(now, left)
        # rows per lane only matter to lanes with a share, and only when there is a row to give
        running = Counter(p.lane for p in self._running.values()) if free and self.scheduler.shares_apply else None
        plan = self.scheduler.plan(now, free, 0 if holding else len(preemptible), running)
        out.extend(expired_outcome(p.payload[0], self._worker, now,
                                   "or became unreachable (its estimated compute would end after it) while queued")
                   for p in plan.expired)
        for p in plan.expired:
            metrics.EXPIRED_BEFORE_COMPUTE.labels(self.name, p.lane).inc()
        if plan.preempt:
            self._preempt(preemptible, plan.preempt)
        if plan.batch:
            out.extend(self._start(plan.batch))
        if self.runner.busy:
            rows = len(self._running)
            t0 = self._clock()
            out.extend(self._step())
            t1 = self._clock()
            # the token interval a running row sees: its step plus everything else this iteration did
            # (prefills of newcomers, the start gate); that, not the bare step, is what deadlines depend
            # on. Abnormally long waits on Redis are left out.
            since = self._last_step_end if self._last_step_end is not None else t0
            self.tracker.observe_step(rows, max(t1 - t0, t1 - since - self._excluded_s))
            self._last_step_end = t1
        else:
            self._last_step_end = None
        self._excluded_s = 0.0
        self._finished(out)
        self._refresh()
        if out:
            self._emit(out)
        if draining and (not self.runner.busy or self._clock() >= (self._drain_until or 0)):
            self._hand_back()
            return None
        # rows freed by this round's step may take queued work at once: no waiting for a command then
        if plan.batch or self.runner.busy or self._last_step_end is not None:
            return None
        return self._idle(plan.wake_at, now, block)

    def _idle(self, wake_at: float | None, now: float, block: bool) -> float | None:
        """Nothing to compute: wait for a command, at most until the scheduler's next wake-up."""
        cap = self._idle_wait_s
        wait = cap if wake_at is None else max(0.0, min(cap, wake_at - now))
        if not block:
            return wait
        self._receive(block=True, timeout=wait)
        return None

    def _step(self) -> list[Emitted]:
        """One decode step; if the model raises, the rows running now fail (not the loop, not the worker)."""
        try:
            return list(self.runner.step())
        except Exception as exc:
            log.exception("decode step failed; failing the running rows", model=self.name)
            ids = set(self.runner.running_ids())
            self.runner.cancel(ids)
            now = self._clock()
            out: list[Emitted] = []
            for rid in ids:
                p = self._running.pop(rid, None)
                if p is not None:
                    out.append(failed_outcome(p.payload[0], self._worker, now, "model_error",
                                              f"the model raised {type(exc).__name__} while decoding: {exc}",
                                              computed=True))
            return out

    def _start(self, batch: list[Pending]) -> list[Emitted]:
        reqs = [p.payload[0] for p in batch]
        g0 = self._clock()
        live = self._gate(reqs)
        # a normal round trip delays every running row and belongs in the token interval; a stalled one
        # (a Redis blip) says nothing about the model's speed and would make healthy rows look doomed
        self._excluded_s += max(0.0, self._clock() - g0 - GATE_NORMAL_S)
        if live is None:  # Redis cannot say whether they were cancelled: put them back, try again shortly
            for p in batch:
                self.scheduler.add(p)
            self._gate_retry_at = self._clock() + GATE_RETRY_S
            return []
        out: list[Emitted] = [Ack(r) for r, ok in zip(reqs, live, strict=True) if not ok]
        batch = [p for p, ok in zip(batch, live, strict=True) if ok]
        # the gate took a round trip: re-check deadlines right before the model sees the batch
        now = self._clock()
        if self.scheduler.deadline_aware:
            late = [p for p in batch if p.deadline <= now]
            out.extend(expired_outcome(p.payload[0], self._worker, now, "before prefill") for p in late)
            for p in late:
                metrics.EXPIRED_BEFORE_COMPUTE.labels(self.name, p.lane).inc()
            batch = [p for p in batch if p.deadline > now]
        if not batch:
            return out
        metrics.BATCH_SIZE.labels(self.name, batch[0].lane).observe(sum(p.size for p in batch))
        for p in batch:
            metrics.QUEUE_WAIT.labels(self.name, p.lane).observe(max(0.0, now - p.payload[0].created_ms / 1000))
            if p.deadline <= now:  # only possible in FIFO mode: the baseline's wasted work
                metrics.COMPUTE_ON_EXPIRED.labels(self.name).inc()
            self._running[p.id] = p
        self._faults.point("kill_at_prefill")
        t0 = self._clock()
        out.extend(self.runner.start(batch, now))
        self.tracker.observe_prefill(sum(p.prompt_tokens * p.size for p in batch), self._clock() - t0)
        return out

    def _free_rows(self, now: float, left: dict[str, int]) -> int:
        """Rows new work may take this round."""
        free = self.runner.free_rows
        if free and self.scheduler.deadline_aware:
            free = min(free, self._deadline_room(now, left))
        if free and self.yielding:
            free = self._rows_while_yielding(now, free)
        return free

    def _rows_while_yielding(self, now: float, free: int) -> int:
        """A background turn beside the first engine's running rows prefills nothing, so that a short
        request never waits out a long prompt between two of its tokens; work that has waited
        `BACKGROUND_PREFILL_WAIT_S` gets one row (the idle gaps of the first engine usually come sooner)."""
        oldest = [t for q in self.scheduler.queues.values() if (t := q.oldest_arrival()) is not None]
        return min(free, 1) if oldest and now - min(oldest) >= BACKGROUND_PREFILL_WAIT_S else 0

    def _deadline_room(self, now: float, left: dict[str, int]) -> int:
        """Rows that may join without pushing a running row past its deadline: every row slows every
        step, and each running row must still fit its remaining tokens into the time it has left. Under
        overload, admitting past this point starts work that is then evicted unfinished (its compute
        wasted, and everyone slowed while it ran)."""
        budgets = [(p.deadline - now) / n for rid, n in left.items()
                   if n > 0 and (p := self._running.get(rid)) is not None]
        if not budgets:
            return self.runner.free_rows
        return max(0, self.tracker.rows_within(min(budgets), self.max_rows) - len(self._running))

    def _evict_doomed(self, now: float, left: dict[str, int]) -> list[Outcome]:
        """Running rows that cannot finish by their deadline at the measured token interval leave now
        (partial output kept) instead of taking rows and steps from work that can still make it."""
        interval = self.tracker.step_seconds(max(1, len(self._running)))
        if interval <= 0:
            return []
        doomed = {rid for rid, n in left.items()
                  if (p := self._running.get(rid)) is not None and now + DOOM_OPTIMISM * n * interval > p.deadline}
        return list(self.runner.expire_ids(doomed)) if doomed else []

    def _preempt(self, candidates: list[Pending], rows: int) -> None:
        """Give rows of running batch-priority work to urgent interactive work; re-queue the victims."""
        victims = sorted(candidates, key=lambda p: -p.deadline)[:rows]
        self.runner.cancel({p.id for p in victims})  # their partial work is dropped, not published
        for p in victims:
            self._running.pop(p.id, None)
            self.scheduler.add(p)
            metrics.PREEMPTIONS.labels(self.name).inc()
        log.info("preempted batch-priority rows for interactive work", model=self.name, count=len(victims))

    def _finished(self, out: list[Emitted]) -> None:
        for item in out:
            if isinstance(item, Outcome):
                p = self._running.pop(item.request.id, None)
                if p is not None and item.computed:
                    self.tracker.observe_completion(p.lane)

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

    def _apply(self, cmd: Add | Adopt | Cancel | Drain) -> None:
        if isinstance(cmd, Add):
            self._add(cmd)
        elif isinstance(cmd, Adopt):
            for item in cmd.items:
                self.scheduler.add(item)
        elif isinstance(cmd, Cancel):
            acks: list[Emitted] = []
            for rid in cmd.ids:
                item = self.scheduler.cancel(rid)
                if item is not None:
                    acks.append(Ack(item.payload[0]))
            cancelled = self.runner.cancel(cmd.ids)
            for o in cancelled:
                self._running.pop(o.request.id, None)
            acks.extend(cancelled)
            if acks:
                self._emit(acks)
        else:
            self._drain_until = cmd.until
            waiting = [p.payload[0] for p in self.scheduler.drain()]
            if waiting:  # queued work goes back at once; only running rows use the drain budget
                self._emit([HandBack(waiting)])

    def _add(self, cmd: Add) -> None:
        out: list[Emitted] = []
        elsewhere: list[Pending] = []
        for req in cmd.requests:
            try:
                item = self.runner.prepare(req, cmd.arrived)
            except Exception as exc:  # an entry no validation of ours produced (another producer, schema)
                log.warning("request could not be prepared", request_id=req.id, error=repr(exc))
                item = failed_outcome(req, self._worker, self._clock(), "invalid_input",
                                      f"the request could not be prepared: {type(exc).__name__}: {exc}")
            if not isinstance(item, Pending):
                out.append(item)
            elif self._hand_over is not None and item.lane not in self.scheduler.queues:
                elsewhere.append(item)  # the real tokenizer put it in a lane another engine serves
            else:
                self.scheduler.add(item)
        if out:
            self._emit(out)
        if elsewhere and self._hand_over is not None:
            self._hand_over(elsewhere)

    def _hand_back(self) -> None:
        waiting = [p.payload[0] for p in self.scheduler.drain()]
        running = self.runner.cancel(set(self.runner.running_ids()))
        reqs = waiting + [o.request for o in running]
        self._running.clear()
        self._emit([HandBack(reqs)])
        self.stopped = True

    # --- load figures --------------------------------------------------------------------------
    def _refresh(self) -> None:
        now = time.monotonic()
        dt = now - self._last_metrics
        if dt < METRICS_INTERVAL_S and self.snapshot.at:
            return
        self._last_metrics = now
        self.tracker.tick(dt, busy=bool(self._running) or len(self.scheduler) > 0)
        running_lanes = Counter(p.lane for p in self._running.values())
        rows = max(1, len(self._running))
        self.scheduler.service = self.tracker.service_model(rows)
        free = self.runner.free_rows
        step_ms = self.tracker.step_seconds(max(rows, 1)) * 1000
        work = [*self._running.values(), *(p for q in self.scheduler.queues.values() for p in q.items())]
        mean_s = sum(self.scheduler.service.estimate(p) for p in work) / len(work) if work else 1.0
        lanes: dict[str, LaneLoad] = {}
        for lane, q in self.scheduler.queues.items():
            rate = self.tracker.counters[lane].rate if lane in self.tracker.counters else 0.0
            wait_ms = lane_wait_ms(window_s=q.policy.window_s, waiting=len(q), free_rows=free,
                                   drain_rps=self.tracker.total_rate(), max_rows=self.max_rows, mean_service_s=mean_s)
            lanes[lane] = LaneLoad(len(q), running_lanes.get(lane, 0), rate, wait_ms)
            metrics.WORKER_BACKLOG.labels(self.name, lane).set(len(q))
        self.snapshot = Snapshot(
            at=time.time(), lanes=lanes, max_rows=self.max_rows, free_rows=free,
            prefill_fixed_ms=self.tracker.prefill.intercept * 1000,
            prefill_ms_per_token=self.tracker.prefill.slope * 1000, decode_ms_per_step=step_ms,
        )
        metrics.RUNNING.labels(self.name).set(len(self._running))
        self._engine_metrics(dt)

    def _engine_metrics(self, dt: float) -> None:
        stats = self.runner.engine_stats()
        if stats is None or dt <= 0:
            return
        prev = self._last_stats
        metrics.TOKENS_PER_S.labels(self.name).set((stats.decode_tokens - prev.decode_tokens) / dt)
        metrics.PHASE_SECONDS.labels(self.name, "prefill").inc(stats.prefill_s - prev.prefill_s)
        metrics.PHASE_SECONDS.labels(self.name, "decode").inc(stats.decode_s - prev.decode_s)
        padded = stats.kv_padded - prev.kv_padded
        if padded:
            metrics.KV_PADDING.labels(self.name).set(1 - (stats.kv_real - prev.kv_real) / padded)
        self._last_stats = dataclasses.replace(stats)
