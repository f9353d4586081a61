"""A compute loop's load, as the worker publishes it for the gateway's admission control, and its
Prometheus figures. Read from the scheduler (queues, running set, measured costs) and the runner."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpu_worker import metrics
from gpu_worker.load_outlook import preemptible, row_frees_ms, waiting_order
from gpu_worker.scheduler import Scheduler
from gpu_worker.service_model import lane_wait_ms

METRICS_INTERVAL_S = 1.0


@dataclass(frozen=True, slots=True)
class LaneLoad:
    waiting: int
    running: int
    completed_rps: float
    est_wait_ms: float
    order: tuple[tuple[int, int], ...] = ()  # `load_outlook.waiting_order`
    frees_ms: tuple[int, ...] = ()  # `load_outlook.row_frees_ms`


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
    decode_ms_per_row: float = 0.0  # what one more running row adds to a step
    oldest_wait_s: float = 0.0  # how long its longest-waiting request has waited (0: none waits)
    preemptible: int = 0  # `load_outlook.preemptible`


class LoadReport:
    """Refreshes a loop's `Snapshot` and metrics at most once per `METRICS_INTERVAL_S`."""

    def __init__(self, model: str, max_rows: int) -> None:
        self.model = model
        self.max_rows = max_rows
        self.snapshot = Snapshot()
        self._last = time.monotonic()
        self._last_stats: Any = None

    def refresh(self, scheduler: Scheduler, runner: Any, clock_now: float | None = None) -> None:
        """`runner`: the loop's (its free rows, the tokens its rows have left, its engine's counters); `clock_now`: the
        compute loop's clock (the one its jobs' arrival times and deadlines are on); wall time by default."""
        now = time.monotonic()
        dt = now - self._last
        if dt < METRICS_INTERVAL_S and self.snapshot.at:
            return
        self._last = now
        free_rows, wall = runner.free_rows, time.time() if clock_now is None else clock_now
        tracker = scheduler.tracker
        tracker.tick(dt, busy=bool(scheduler.running) or len(scheduler) > 0)
        scheduler.refresh_estimates()
        rows = max(1, len(scheduler.running))
        running_lanes = Counter(job.lane for job in scheduler.running.values())
        work = [*scheduler.running.values(), *(p for q in scheduler.queues.values() for p in q.items())]
        step_s = tracker.forecast_step_seconds(rows)
        frees = row_frees_ms(scheduler.running.values(), runner.remaining_tokens(), wall, step_s,
                             {lane: c.stop_share for lane, c in tracker.counters.items()})
        mean_s = sum(scheduler.service.estimate(p) for p in work) / len(work) if work else 1.0
        lanes: dict[str, LaneLoad] = {}
        # its own lanes; a lane it takes only as overflow while it has such work (then it is where that lane's
        # requests wait and run, and admission must see it), listed first: the scheduler starts it first
        for lane, q in scheduler.queues.items():
            if lane not in scheduler.own_lanes and not len(q) and not running_lanes.get(lane):
                continue
            rate = tracker.counters[lane].rate if lane in tracker.counters else 0.0
            wait_ms = lane_wait_ms(window_s=q.policy.window_s, waiting=len(q), free_rows=free_rows,
                                   drain_rps=tracker.total_rate(), max_rows=self.max_rows, mean_service_s=mean_s)
            order = waiting_order(q.items()) if scheduler.deadline_aware and not q.fifo else ()
            lanes[lane] = LaneLoad(len(q), running_lanes.get(lane, 0), rate, wait_ms, order, tuple(frees.get(lane, ())))
            if lane in scheduler.own_lanes:  # the lane's own engine reports its backlog gauge
                metrics.WORKER_BACKLOG.labels(self.model, lane).set(len(q))
        self.snapshot = Snapshot(
            at=time.time(), lanes=lanes, max_rows=self.max_rows, free_rows=free_rows,
            prefill_fixed_ms=tracker.prefill.intercept * 1000, prefill_ms_per_token=tracker.prefill.slope * 1000,
            decode_ms_per_step=step_s * 1000,
            decode_ms_per_row=tracker.forecast_row_seconds(rows) * 1000,
            oldest_wait_s=max(0.0, wall - oldest) if (oldest := scheduler.oldest_arrival()) is not None else 0.0,
            preemptible=preemptible(scheduler.running.values()) if scheduler.deadline_aware else 0,
        )
        metrics.RUNNING.labels(self.model).set(len(scheduler.running))
        self._engine_metrics(runner.engine_stats(), dt)

    def _engine_metrics(self, stats: Any, dt: float) -> None:
        if stats is None or dt <= 0:
            return
        prev = self._last_stats or type(stats)()
        metrics.TOKENS_PER_S.labels(self.model).set((stats.decode_tokens - prev.decode_tokens) / dt)
        metrics.PHASE_SECONDS.labels(self.model, "prefill").inc(stats.prefill_s - prev.prefill_s)
        metrics.PHASE_SECONDS.labels(self.model, "decode").inc(stats.decode_s - prev.decode_s)
        padded = stats.kv_padded - prev.kv_padded
        if padded:
            metrics.KV_PADDING.labels(self.model).set(1 - (stats.kv_real - prev.kv_real) / padded)
        self._last_stats = dataclasses.replace(stats)
