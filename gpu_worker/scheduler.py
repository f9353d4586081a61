"""The worker's scheduling decisions, pure: requests, a clock value and capacity in; a plan out.

No Redis, no torch, no clock reads. The scheduler owns the lane queues and the running set, and each
time the compute loop asks, `plan()` answers every question of the step:
1. which running rows cannot finish by their deadline (past it, or their remaining tokens at the
   measured token interval would end past it): they leave now with their partial output;
2. which waiting requests cannot finish by their deadline (past it, or past it once their estimated
   compute is done): they expire without compute (under overload, starting work that will miss
   anyway is how EDF collapses);
3. how many rows new work may take: the free rows, fewer if another row would push a running row past its deadline
   (every row slows every step), none while starting is held off (draining, or the record store could not confirm
   the last batch), at most one for old work while the engine yields its turns to a foreground engine;
4. is some lane's dynamic window closed (its batch is full, its token budget is full, its oldest
   request has waited the lane's window, or the earliest deadline's slack says waiting longer would
   miss it), and if several are, which lane is most urgent: interactive before batch; then a lane
   whose slack has run out (most overdue first); then the lane whose requests have waited the most *windows* past
   their expected start (`DynamicStage.urgency`: short windows, short work first; none starves); each lane within
   its share of the rows, the lanes after the first together within `long_rows` until their queues back up
   (`DynamicStage.held_to_long_rows`);
5. with no row free and an interactive request out of slack: which running batch-priority rows to
   give back (they are re-queued), so batch work never pushes interactive work past its deadline;
6. if nothing is ready, when to ask again.
Whether a deadline can be met is answered by `shared.deadlines.cannot_finish` alone.
With `deadline_aware=False` (the FIFO baseline the benchmarks compare against) requests are taken
in arrival order and deadlines are ignored: nothing expires or is evicted, no slack closes a window.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpu_worker import prefill_budget, running_deadlines
from gpu_worker.dynamic_stage import BatchLimits, DynamicStage
from gpu_worker.job import Job, JobState
from gpu_worker.lane_queue import LanePolicy, LaneQueue
from gpu_worker.service_model import ServiceModel, ServiceTracker
from shared.deadlines import cannot_finish

# While its engine yields to a foreground engine with running rows (CPU engines taking turns on one
# thread) and chunked prefill is off, a background turn starts no prefill (a 256-token prompt's forward takes
# ~100 ms on the 2-core VM, and every short row would wait it out) unless work has waited this long; then it
# starts one request. With chunked prefill on, `gpu_worker.prefill_budget` bounds such a turn instead.
BACKGROUND_PREFILL_WAIT_S = 0.5


@dataclass(slots=True)
class Plan:
    evict: list[Job] = field(default_factory=list)  # running rows that cannot finish: leave now
    expired: list[Job] = field(default_factory=list)  # waiting requests that cannot finish: never computed
    preempt: list[Job] = field(default_factory=list)  # running batch rows given back to interactive work
    batch: list[Job] = field(default_factory=list)  # to start now, all of one lane
    chunked: Job | None = None  # a long prompt to prefill a chunk per step beside the decoding rows
    chunk_tokens: int = 0  # prompt tokens of a chunked prefill this step may add
    lane: str | None = None
    wake_at: float | None = None  # ask again at this time if nothing else happens first


class Scheduler(DynamicStage):
    def __init__(self, lanes: Iterable[LanePolicy], limits: BatchLimits, *, aging: float = 1.0,
                 service: ServiceModel | None = None, deadline_aware: bool = True,
                 total_rows: int | None = None, chunk_tokens: int | None = None,
                 overflow: Iterable[LanePolicy] = (), fused: bool = False, long_rows: int | None = None) -> None:
        self.deadline_aware = deadline_aware
        self.long_rows = long_rows
        self.fused = fused  # chunks ride in the decode steps' forwards: sized per step (`_fused_chunk`)
        self._chunk_id: str | None = None  # the job whose prompt is being chunked
        self._fused_last = 0  # tokens of the last fused chunk planned
        self.total_rows = total_rows  # rows of the running batch (for lane shares); None: shares unused
        # a step's prefill budget while rows decode, before the costs are measured; None: no chunked prefill
        self.chunk_tokens = chunk_tokens
        lanes = list(lanes)
        self.own_lanes = tuple(lane.name for lane in lanes)
        # lanes this engine takes only when its model's other engines send it their work (the model is
        # saturated: see `gpu_worker.engines`); queued and planned like its own, in lane order, shortest first
        self.queues = {lane.name: LaneQueue(lane, fifo=not deadline_aware) for lane in [*overflow, *lanes]}
        self.limits = limits
        self.aging = aging
        self.service = service or ServiceModel()
        self.tracker = ServiceTracker(tuple(self.queues))
        self.running: dict[str, Job] = {}
        self._hold_until = 0.0

    # --- bookkeeping ---------------------------------------------------------------------------
    def add(self, job: Job) -> None:
        queue = self.queues.get(job.lane)
        if queue is None:  # an unknown lane name (config changed under a queued request): last lane
            queue = list(self.queues.values())[-1]
            job.lane = queue.policy.name
        job.state = JobState.QUEUED
        queue.push(job)

    def cancel(self, request_id: str) -> Job | None:
        """Take a waiting request out of its queue (a running one is removed by the runner, then `finished`)."""
        for queue in self.queues.values():
            job = queue.remove(request_id)
            if job is not None:
                job.state = JobState.DONE
                return job
        return None

    def started(self, jobs: Iterable[Job]) -> None:
        for job in jobs:
            job.state = JobState.RUNNING
            job.attempts += 1
            self.running[job.id] = job

    def finished(self, request_id: str) -> Job | None:
        job = self.running.pop(request_id, None)
        if job is not None:
            job.state = JobState.DONE
        return job

    def requeue(self, jobs: Iterable[Job]) -> None:
        """Running jobs given back (preempted): waiting again, in their lanes."""
        for job in jobs:
            self.running.pop(job.id, None)
            self.add(job)

    def hold(self, until: float) -> None:
        """Start nothing before `until` (the record store could not confirm a batch; `inf` when draining)."""
        self._hold_until = until

    def drain(self) -> list[Job]:
        """Everything still waiting (for a hand-back on shutdown)."""
        out: list[Job] = []
        for queue in self.queues.values():
            while len(queue):
                job = queue.pop()
                job.state = JobState.DONE
                out.append(job)
        return out

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def backlog(self) -> dict[str, int]:
        return {name: len(q) for name, q in self.queues.items()}

    def oldest_arrival(self) -> float | None:
        return min((t for q in self.queues.values() if (t := q.oldest_arrival()) is not None), default=None)

    def refresh_estimates(self) -> None:
        """Take the latest measured costs as the estimate used for slack and expiry."""
        self.service = self.tracker.service_model(max(1, len(self.running)))

    # --- decisions -----------------------------------------------------------------------------
    def plan(self, now: float, free_rows: int, left: Mapping[str, int] | None = None, *,
             yielding: bool = False, chunking: bool = False, background: bool = False, chunk_left: int = 0) -> Plan:
        """`free_rows`: rows the runner has free now; `left`: tokens each running row still has to generate;
        `background`: a foreground engine shares this engine's compute thread; `yielding`: and has rows running
        now (both bound this turn's prefill); `chunking`: a long prompt is being prefilled a chunk per step,
        `chunk_left` of its tokens still to go."""
        plan = Plan()
        budget = self.step_budget(chunking, background=background, yielding=yielding)
        plan.chunk_tokens = budget or self.limits.max_batch_tokens  # no decoding row to protect: all at once
        if self.fused and chunking and budget:
            plan.chunk_tokens = min(budget, self._fused_chunk(now, chunk_left))
        remaining = dict(left or {})
        if self.deadline_aware:
            plan.evict = self._unfinishable(now, remaining)
            for job in plan.evict:
                remaining.pop(job.id, None)
            free_rows = min(free_rows + len(plan.evict), self._deadline_room(now, remaining, free_rows))
            for queue in self.queues.values():
                plan.expired.extend(queue.pop_expired(now, self.service))
        if yielding and budget is None:  # no chunked prefill to bound the turn: hold prefills back instead
            free_rows = self._rows_while_yielding(now, free_rows)
        holding = now < self._hold_until
        if holding or free_rows <= 0:
            if self.deadline_aware and not holding:
                plan.preempt = self._victims(now, {j.id for j in plan.evict})
            return plan
        gone = {j.id for j in plan.evict}
        running = Counter(j.lane for j in self.running.values() if j.id not in gone) if self.shares_apply else Counter()
        rows = {name: self.lane_rows(q, free_rows, running, now) for name, q in self.queues.items() if len(q)}
        ready, wake = self._ready_lanes(now, rows, budget, chunking)
        if not ready:
            plan.wake_at = min(wake, default=None)
            return plan
        lane = min(ready, key=lambda q: self.urgency(q, now))
        plan.lane = lane.policy.name
        head = lane.peek()
        if budget and head is not None and head.prompt_tokens > budget:
            plan.chunked = lane.pop()  # too long for one step beside the decoding rows: in chunks
            self._chunk_id = plan.chunked.id
            if self.fused:  # its first chunk rides in this round's decode step already
                plan.chunk_tokens = min(budget, self._fused_chunk(now, plan.chunked.prompt_tokens, plan.chunked))
            return plan
        plan.batch = self._batch(lane, rows[lane.policy.name], budget, now, remaining)
        if budget and chunking:  # new prompts first within the step's budget; the chunk gets the rest
            plan.chunk_tokens = min(plan.chunk_tokens,
                                    max(budget // 4, budget - sum(j.prompt_tokens * j.size for j in plan.batch)))
        return plan

    def _ready_lanes(self, now: float, rows: Mapping[str, int], budget: int | None,
                     chunking: bool) -> tuple[list[LaneQueue], list[float]]:
        """Lanes whose window has closed, and when the others' will (a lane at its share waits, like an empty
        one; so does one whose head must wait for the chunked prefill in progress)."""
        ready: list[LaneQueue] = []
        wake: list[float] = []
        for queue in self.queues.values():
            if rows.get(queue.policy.name, 0) > 0 and not self._waits_for_chunk(queue, budget, chunking):
                at = self.ready_at(queue, now)
                if at <= now:
                    ready.append(queue)
                else:
                    wake.append(at)
        return ready, wake

    def step_budget(self, chunking: bool, *, background: bool = False, yielding: bool = False) -> int | None:
        """Prompt tokens one step may prefill (see `gpu_worker.prefill_budget.step_budget`)."""
        decoding = len(self.running) - int(chunking)
        return prefill_budget.step_budget(self.chunk_tokens, decoding, background=background, yielding=yielding)

    def _fused_chunk(self, now: float, chunk_left: int, starting: Job | None = None) -> int:
        """Prompt tokens the next fused step carries (see `gpu_worker.prefill_budget.fused_chunk`)."""
        chunk_job = starting or (self.running.get(self._chunk_id) if self._chunk_id else None)
        rows = [j for j in self.running.values() if j is not chunk_job]
        t = self.tracker
        if starting is not None:
            self._fused_last = 0
        self._fused_last = prefill_budget.fused_chunk(
            self.chunk_tokens, protect=any(j.rank == 0 for j in rows),
            line=t.fused_line, recent=list(t.recent_fused), bare_step_s=t.bare.predict(len(rows)) if t.bare.n else 0.0,
            interval_s=t.step_seconds(len(self.running)), chunk_left=chunk_left,
            deadline_left_s=chunk_job.deadline - now if chunk_job is not None and self.deadline_aware else None,
            new_tokens=chunk_job.new_tokens if chunk_job is not None else 0, previous=self._fused_last)
        return self._fused_last

    def _waits_for_chunk(self, queue: LaneQueue, budget: int | None, chunking: bool) -> bool:
        """A lane whose head needs chunks waits while another prompt is being chunked (one at a time), or is
        batch-priority work with no row it may start in now (`gpu_worker.background_rows`)."""
        head = queue.peek()
        return self.background_full(head) or bool(budget and chunking and head and head.prompt_tokens > budget)

    def late(self, batch: list[Job], now: float) -> list[Job]:
        """Of a batch about to start, those already past their deadline (deadline-aware mode only)."""
        return [j for j in batch if cannot_finish(j.deadline, now)] if self.deadline_aware else []

    def _unfinishable(self, now: float, left: Mapping[str, int]) -> list[Job]:
        """Running rows that cannot finish by their deadline at the measured token interval (or are past
        it), to evict while work waits for their rows (`running_deadlines.unfinishable`)."""
        return running_deadlines.unfinishable(self.running, left, now, self.tracker, waiting=len(self) > 0)

    def _deadline_room(self, now: float, left: Mapping[str, int], free_rows: int) -> int:
        """Rows that may join without pushing a running row past its deadline (`running_deadlines.room`)."""
        limit = self.total_rows or free_rows + len(self.running)
        return running_deadlines.room(self.running, left, now, self.tracker, limit)

    def _batch(self, lane: LaneQueue, rows: int, budget: int | None, now: float, left: Mapping[str, int]) -> list[Job]:
        """The lane's batch (`_take`), unless prefilling it now would push a running row past a deadline it can
        keep while the batch can as well start a step later (`running_deadlines.stalled`): then none this turn."""
        batch = self._take(lane, rows, budget)
        if self.deadline_aware and running_deadlines.stalled(self.running, left, now, self.tracker, batch,
                                                              self.latest_start):
            for job in batch:
                lane.push(job)
            return []
        return batch

    def _rows_while_yielding(self, now: float, free_rows: int) -> int:
        """A background turn beside the foreground engine's running rows prefills nothing, so that a short
        request never waits out a long prompt between two of its tokens; work that has waited
        `BACKGROUND_PREFILL_WAIT_S` gets one row (the foreground's idle gaps usually come sooner)."""
        oldest = self.oldest_arrival()
        return min(free_rows, 1) if oldest is not None and now - oldest >= BACKGROUND_PREFILL_WAIT_S else 0

    def _victims(self, now: float, gone: set[str]) -> list[Job]:
        """Running batch-priority rows to give to interactive requests that cannot wait for a row to free
        up on its own, latest deadline first."""
        candidates = [j for j in self.running.values() if j.rank > 0 and j.id not in gone]
        if not candidates:
            return []
        wanted = sum(p.size for q in self.queues.values() for p in q.items()
                     if p.rank == 0 and self.latest_start(p) <= now)
        return sorted(candidates, key=lambda j: -j.deadline)[:wanted]
