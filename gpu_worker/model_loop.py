"""A compute loop: one engine's scheduler and runner, on a thread so torch never blocks the worker's
asyncio I/O. It decides nothing itself: each round asks the scheduler for a plan and carries it out.

    receive commands -> plan (pure scheduler) -> mark running (record store) -> run (runner) -> emit

Commands arrive on a thread-safe inbox (`gpu_worker.commands`); outcomes, acks and hand-backs leave
through `emit`, in lists, to the worker's publisher.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import structlog

from gpu_worker import background_rows, metrics
from gpu_worker.commands import Add, Adopt, Cancel, Command, Release
from gpu_worker.compute_thread import ThreadedLoop
from gpu_worker.job import Job, JobState
from gpu_worker.load_report import LoadReport, Snapshot
from gpu_worker.outcomes import Ack, Emitted, HandBack, Outcome, expired_outcome, failed_outcome
from gpu_worker.rebalance import take
from gpu_worker.runner import Runner
from gpu_worker.scheduler import Plan, Scheduler
from shared.deadlines import cannot_finish
from shared.faults import Faults
from shared.messages import InferenceRequest
from shared.states import FinishReason

log = structlog.get_logger(__name__)

IDLE_WAIT_S = 1.0
GATE_RETRY_S = 0.5  # the record store could not say whether a batch is still live: try again after this
GATE_NORMAL_S = 0.1  # a mark-running round trip up to this long counts in the token interval


class ModelLoop(ThreadedLoop):
    def __init__(self, name: str, runner: Runner, scheduler: Scheduler, *,
                 mark_running: Callable[[list[InferenceRequest]], list[bool] | None],
                 emit: Callable[[list[Emitted]], None], on_crash: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.time, worker: str = "", idle_wait_s: float = IDLE_WAIT_S,
                 faults: Faults | None = None, engine: str = "main",
                 hand_over: Callable[[list[Job]], None] | None = None,
                 bind_thread: Callable[[], str] | None = None) -> None:
        super().__init__(name, engine)
        self.runner = runner
        self.scheduler = scheduler
        self._mark_running = mark_running  # False: already terminal (cancelled); None: the store cannot tell
        self._emit = emit
        self._clock = clock
        self._worker = worker
        self._idle_wait_s = idle_wait_s
        self._faults = faults or Faults()
        self._hand_over = hand_over  # to the engine of a lane this one does not serve
        self._on_crash = on_crash
        self._bind_thread = bind_thread
        self._drain_until: float | None = None
        self.yielding = False  # set by the host: a background turn while the first engine has rows running
        self.background = False  # set by the host: a first (foreground) engine on its compute thread had rows lately
        self.max_rows = runner.free_rows
        self.report = LoadReport(name, self.max_rows)
        self.tracker = scheduler.tracker
        self._last_step_end: float | None = None
        self._excluded_s = 0.0  # time spent waiting on Redis this round (not part of the token interval)
        self._sharing = background_rows.Sharing()  # batch-priority rows sitting out the steps, and why

    @property
    def snapshot(self) -> Snapshot:
        return self.report.snapshot

    @property
    def has_work(self) -> bool:
        """Rows running, requests queued, or commands not yet received."""
        return self.runner.busy or len(self.scheduler) > 0 or not self._inbox.empty()

    def _started(self) -> None:
        if self._bind_thread is not None:
            log.info("compute loop started", model=self.name, engine=self.engine, lanes=list(self.scheduler.queues),
                     rows=self.max_rows, thread=self._bind_thread())

    # --- one round -----------------------------------------------------------------------------
    # Invariant: a request reaches the model only when the scheduler planned it and the record store
    # confirmed, just before, that it is not terminal (a cancelled request is never computed); in
    # deadline-aware mode never past its deadline. Every job taken in leaves as exactly one outcome,
    # ack or hand-back.
    def _iterate(self, block: bool = True) -> float | None:
        """One round: receive, plan, carry out, step, emit. With nothing to compute it waits for a command
        (up to the scheduler's next wake-up) or, if not `block`, returns how long it could wait."""
        self._receive(block=False, timeout=0)
        if self.on_work is not None:
            self.on_work(self.runner.busy or len(self.scheduler) > 0)
        now = self._clock()
        left = self.runner.remaining_tokens() if self.scheduler.deadline_aware else {}
        planned_with = self.scheduler.background_rows  # batch-priority rows it may start, as last reckoned
        plan = self.scheduler.plan(now, self.runner.free_rows, left, yielding=self.yielding,
                                   chunking=self.runner.chunking, background=self.background,
                                   chunk_left=self.runner.chunk_left)
        out = self._carry_out(plan, now)
        self._share_rows(now)
        if plan.batch:  # a streaming newcomer's first token goes out now, not after the step
            self._publish(list(self.runner.take_deltas()))
        out.extend(self._step(plan.chunk_tokens))
        self._publish([*self.runner.take_deltas(), *out])
        self.report.refresh(self.scheduler, self.runner, self._clock())
        if self._drain_until is not None and (not self.runner.busy or self._clock() >= self._drain_until):
            self._hand_back()
            return None
        # rows freed by this round's step may take queued work at once: no waiting for a command then
        if plan.batch or self.runner.busy or self._last_step_end is not None:
            return None
        if len(self.scheduler) and background_rows.widened(planned_with, self.scheduler.background_rows):
            return None  # the share this round planned with was reckoned beside rows a step since ended
        wait = self._idle_wait_s if plan.wake_at is None else max(0.0, min(self._idle_wait_s, plan.wake_at - now))
        if not block:
            return wait
        self._receive(block=True, timeout=wait)
        return None

    def _carry_out(self, plan: Plan, now: float) -> list[Emitted]:
        out: list[Emitted] = []
        if plan.evict:
            out.extend(self.runner.remove({job.id for job in plan.evict}, FinishReason.DEADLINE))
        for job in plan.expired:  # (a preempted row was computed; a stream's caller keeps what it was sent)
            metrics.EXPIRED_BEFORE_COMPUTE.labels(self.name, job.lane).inc(0 if job.attempts else 1)
            kept = job.stream is not None and bool(job.stream.released)
            out.append(self.runner.resumed_whole(job, FinishReason.DEADLINE) if kept else expired_outcome(
                job.req, self._worker, now, "while queued", unreachable=max(0.0, job.deadline - now) or None))
        if plan.preempt:  # their partial work is dropped, not published; they wait again
            self.runner.remove({job.id for job in plan.preempt}, FinishReason.CANCELLED)
            self.scheduler.requeue(plan.preempt)
            metrics.PREEMPTIONS.labels(self.name).inc(len(plan.preempt))
            log.info("preempted batch-priority rows for interactive work", model=self.name, count=len(plan.preempt))
        if plan.batch:
            out.extend(self._start(plan.batch))
        if plan.chunked is not None:
            out.extend(self._start([plan.chunked], chunked=True))
        return out

    def _share_rows(self, now: float) -> None:
        """Which batch-priority rows sit out the next step beside interactive rows, and how many may start next
        round, and with how many prompt tokens (`gpu_worker.background_rows`)."""
        if self.scheduler.deadline_aware:
            self._sharing.apply(self.scheduler, self.runner, self.max_rows, now)

    def _start(self, batch: list[Job], *, chunked: bool = False) -> list[Emitted]:
        g0 = self._clock()
        live = self._mark_running([job.req for job in batch])
        # a normal round trip delays every running row and belongs in the token interval; a stalled one
        # (a Redis blip) says nothing about the model's speed and would make healthy rows look doomed
        self._excluded_s += max(0.0, self._clock() - g0 - GATE_NORMAL_S)
        if live is None:  # the store cannot say whether they were cancelled: put them back, try again shortly
            for job in batch:
                self.scheduler.add(job)
            self.scheduler.hold(self._clock() + GATE_RETRY_S)
            return []
        out: list[Emitted] = [Ack(job.req) for job, ok in zip(batch, live, strict=True) if not ok]
        batch = [job for job, ok in zip(batch, live, strict=True) if ok]
        now = self._clock()  # the round trip took time: the deadlines are checked again
        late = self.scheduler.late(batch, now)
        for job in late:
            metrics.EXPIRED_BEFORE_COMPUTE.labels(self.name, job.lane).inc()
            out.append(expired_outcome(job.req, self._worker, now, "before prefill"))
        if late:
            gone = {job.id for job in late}
            batch = [job for job in batch if job.id not in gone]
        if not batch:
            return out
        metrics.BATCH_SIZE.labels(self.name, batch[0].lane).observe(sum(job.size for job in batch))
        for job in batch:
            metrics.QUEUE_WAIT.labels(self.name, job.lane).observe(max(0.0, now - job.req.created_ms / 1000))
            if cannot_finish(job.deadline, now):  # only possible in FIFO mode: the baseline's wasted work
                metrics.COMPUTE_ON_EXPIRED.labels(self.name).inc()
        self.scheduler.started(batch)
        self._faults.point("kill_at_prefill")
        if chunked:  # its chunks are measured step by step
            out.extend(self.runner.begin_chunked(batch[0], now))
            return out
        t0 = self._clock()
        out.extend(self.runner.start(batch, now))
        self.tracker.observe_prefill(sum(job.prompt_tokens * job.size for job in batch), self._clock() - t0)
        return out

    def _step(self, chunk_tokens: int = 0) -> list[Emitted]:
        """Up to `chunk_tokens` of a chunked prefill, one decode step, and the measured token interval; if the
        model raises, the rows running now fail (not the loop, not the worker)."""
        if not self.runner.busy:
            self._last_step_end = None
            self._excluded_s = 0.0
            return []
        rows = len(self.scheduler.running) - len(self._sharing.held)  # the rows this step advances
        t0 = self._clock()
        try:
            out: list[Emitted] = list(self.runner.step(chunk_tokens))
        except Exception as exc:
            log.exception("decode step failed; failing the running rows", model=self.name)
            self.runner.remove(set(self.runner.running_ids()), FinishReason.ERROR)
            message = f"the model raised {type(exc).__name__} while decoding: {exc}"
            out = [failed_outcome(job.req, self._worker, self._clock(), "model_error", message, computed=True)
                   for job in list(self.scheduler.running.values())]
        t1 = self._clock()
        # the token interval a running row sees: its step plus all else this round did (newcomers' prefills, the
        # mark-running round trip; not abnormally long waits on Redis): what deadlines depend on, not the bare step
        since = self._last_step_end if self._last_step_end is not None else t0
        chunk, chunk_s = self.runner.last_chunk
        self.tracker.observe_round(rows, t1 - t0, max(t1 - t0, t1 - since - self._excluded_s), chunk, chunk_s,
                                   fused=self.runner.fused, chunking=self.runner.chunking)
        self._last_step_end, self._excluded_s = t1, 0.0
        return out

    def _publish(self, out: list[Emitted], *, count: bool = True) -> None:
        """Jobs with an outcome leave the running set (a computed one counts as a completion); then emit."""
        for item in out:
            if isinstance(item, Outcome):
                job = self.scheduler.finished(item.request.id)
                if job is not None and item.computed and count:
                    self.tracker.observe_completion(job.lane, item.stop_share)
        if out:
            self._emit(out)

    # --- commands ------------------------------------------------------------------------------
    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Add):
            self._add(cmd)
        elif isinstance(cmd, Adopt):
            for job in cmd.items:
                self.scheduler.add(job)
        elif isinstance(cmd, Cancel):
            acks: list[Emitted] = [Ack(job.req) for rid in cmd.ids if (job := self.scheduler.cancel(rid)) is not None]
            self._publish([*acks, *self.runner.remove(cmd.ids, FinishReason.CANCELLED)], count=False)
        elif isinstance(cmd, Release):  # another worker has rows to spare (`gpu_worker.rebalance`)
            if self._drain_until is None and (jobs := take(self.scheduler.queues, self.runner.free_rows, cmd)):
                metrics.HANDED_TO_PEERS.labels(self.name).inc(len(jobs))
                self._emit([HandBack([dataclasses.replace(job.req, moved=job.req.moved + 1) for job in jobs])])
        else:
            self._drain_until = cmd.until
            self.scheduler.hold(float("inf"))
            waiting = [job.req for job in self.scheduler.drain()]
            if waiting:  # queued work goes back at once; only running rows use the drain budget
                self._emit([HandBack(waiting)])

    def _add(self, cmd: Add) -> None:
        out: list[Emitted] = []
        elsewhere: list[Job] = []
        for req in cmd.requests:
            try:
                item = self.runner.prepare(req, cmd.arrived)
            except Exception as exc:  # an entry no validation of ours produced (another producer, schema)
                log.warning("request could not be prepared", request_id=req.id, error=repr(exc))
                item = failed_outcome(req, self._worker, self._clock(), "invalid_input",
                                      f"the request could not be prepared: {type(exc).__name__}: {exc}")
            if not isinstance(item, Job):
                out.append(item)
            elif self._hand_over is not None and item.lane not in self.scheduler.own_lanes:
                elsewhere.append(item)  # the real tokenizer put it in a lane another engine serves
            else:
                self.scheduler.add(item)
        if out:
            self._emit(out)
        if elsewhere and self._hand_over is not None:
            self._hand_over(elsewhere)

    def _hand_back(self) -> None:
        waiting = [job.req for job in self.scheduler.drain()]
        running = self.runner.remove(set(self.runner.running_ids()), FinishReason.CANCELLED)
        for job in list(self.scheduler.running.values()):
            self.scheduler.finished(job.id)
            job.state = JobState.DONE
        self._emit([HandBack(waiting + [o.request for o in running])])
        self.stopped = True
