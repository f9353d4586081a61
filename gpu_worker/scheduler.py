"""The worker's scheduling decisions, pure: requests, a clock value and capacity in; a plan out.

No Redis, no torch, no clock reads. Per lane, waiting requests are ordered by (priority, deadline)
(EDF within a priority). `plan()` answers three questions each time the model loop asks:
1. which waiting requests can no longer finish by their deadline: already past it, or past it by the
   time their estimated compute would end (expire them without compute: under overload, starting
   work that will miss anyway is how EDF collapses);
2. is some lane's dynamic window closed (its batch is full, its token budget is full, its oldest
   request has waited the lane's window, or the earliest deadline's slack says waiting longer would
   miss it), and if several are, which lane is most urgent: interactive before batch; then a lane
   whose slack has run out (most overdue first); then the lane whose oldest request has waited the
   most *windows* (short lanes have short windows, so short work goes first, and every lane's
   urgency grows while it waits, so none starves);
3. if nothing is ready, when to ask again.
With `deadline_aware=False` (the FIFO baseline the benchmarks compare against) requests are taken
in arrival order and deadlines are ignored: nothing expires, no slack closes a window early.
Priorities: when no row is free and an interactive request has no slack left, the plan asks the
caller to preempt running batch-priority rows (they are re-queued), so batch work never pushes
interactive work past its deadline.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SLACK_FACTOR = 1.5
SLACK_MARGIN_S = 0.02


@dataclass(slots=True)
class Pending:
    id: str
    lane: str
    rank: int  # 0 interactive, 1 batch
    deadline: float  # wall-clock seconds
    arrived: float  # when this worker received it
    tokens: int  # estimated total tokens (prompt + max_new_tokens, or input tokens)
    prompt_tokens: int  # longest sequence to prefill / encode (sets the padded width)
    size: int = 1  # rows it occupies in a batch (texts for embeddings)
    new_tokens: int = 0  # tokens to generate (0 for encoders)
    payload: Any = None


@dataclass(frozen=True, slots=True)
class LanePolicy:
    name: str
    window_s: float
    # the largest fraction of the running batch's rows this lane may hold; below 1 the other lanes keep
    # rows of their own (long work never takes every row, so short work never queues behind it)
    max_share: float = 1.0


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int  # rows per batch
    max_batch_tokens: int  # padded prompt tokens per batch (rows x longest prompt)


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Estimated compute time of a request: its prefill (fixed + per padded prompt token) plus one
    decode step per new token. Measured by the worker (`gpu_worker.service_model`)."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    decode_s_per_token: float = 0.0

    def estimate(self, item: Pending) -> float:
        return (self.fixed_s + self.per_token_s * item.prompt_tokens * item.size
                + self.decode_s_per_token * item.new_tokens)


@dataclass(slots=True)
class Plan:
    expired: list[Pending] = field(default_factory=list)
    batch: list[Pending] = field(default_factory=list)
    lane: str | None = None
    wake_at: float | None = None  # ask again at this time if nothing else happens first
    preempt: int = 0  # rows of running batch-priority work to give back to urgent interactive work


class LaneQueue:
    """Waiting requests of one lane, popped in (priority, deadline, arrival) order."""

    def __init__(self, policy: LanePolicy, *, fifo: bool = False) -> None:
        self.policy = policy
        self.fifo = fifo
        self._heap: list[tuple[int, float, int, Pending]] = []  # (rank, deadline | arrival, seq, item)
        self._live: dict[str, Pending] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def push(self, item: Pending) -> None:
        self._live[item.id] = item
        key = (0, item.arrived) if self.fifo else (item.rank, item.deadline)
        heapq.heappush(self._heap, (*key, next(self._seq), item))

    def remove(self, request_id: str) -> Pending | None:
        item = self._live.pop(request_id, None)  # its heap entry is skipped when it surfaces
        self._compact()
        return item

    def _compact(self) -> None:
        """Rebuild the heap when removed entries (still holding their payloads) outnumber live ones."""
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[3].id) is e[3]]
            heapq.heapify(self._heap)

    def _clean_top(self) -> None:
        while self._heap and self._live.get(self._heap[0][3].id) is not self._heap[0][3]:
            heapq.heappop(self._heap)

    def peek(self) -> Pending | None:
        self._clean_top()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Pending:
        self._clean_top()
        item = heapq.heappop(self._heap)[3]
        del self._live[item.id]
        return item

    def items(self) -> Iterable[Pending]:
        return self._live.values()

    def oldest_arrival(self) -> float | None:
        return min((p.arrived for p in self._live.values()), default=None)

    def pop_expired(self, now: float, service: ServiceModel | None = None) -> list[Pending]:
        """Remove requests that cannot finish in time: past the deadline, or past it once computed."""
        gone = [p for p in self._live.values()
                if p.deadline <= now + (service.estimate(p) if service is not None else 0.0)]
        for p in gone:
            del self._live[p.id]
        if gone:
            self._compact()
        return gone


class Scheduler:
    def __init__(self, lanes: Iterable[LanePolicy], limits: BatchLimits, *, aging: float = 1.0,
                 service: ServiceModel | None = None, deadline_aware: bool = True,
                 total_rows: int | None = None) -> None:
        self.deadline_aware = deadline_aware
        self.total_rows = total_rows  # rows of the running batch (for lane shares); None: shares unused
        self.queues = {lane.name: LaneQueue(lane, fifo=not deadline_aware) for lane in lanes}
        self.limits = limits
        self.aging = aging
        self.service = service or ServiceModel()

    # --- bookkeeping ---------------------------------------------------------------------------
    def add(self, item: Pending) -> None:
        queue = self.queues.get(item.lane)
        if queue is None:  # an unknown lane name (config changed under a queued request): last lane
            queue = list(self.queues.values())[-1]
            item.lane = queue.policy.name
        queue.push(item)

    def cancel(self, request_id: str) -> Pending | None:
        for queue in self.queues.values():
            item = queue.remove(request_id)
            if item is not None:
                return item
        return None

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def backlog(self) -> dict[str, int]:
        return {name: len(q) for name, q in self.queues.items()}

    def drain(self) -> list[Pending]:
        """Everything still waiting (for a hand-back on shutdown)."""
        out: list[Pending] = []
        for queue in self.queues.values():
            while len(queue):
                out.append(queue.pop())
        return out

    # --- decisions -----------------------------------------------------------------------------
    def ready_at(self, queue: LaneQueue, now: float) -> float:
        """When this non-empty lane's dynamic window closes (<= now: ready)."""
        items = list(queue.items())
        size = sum(p.size for p in items)
        width = max(p.prompt_tokens for p in items)
        if size >= self.limits.max_batch_size or size * width >= self.limits.max_batch_tokens:
            return now
        close = min(p.arrived for p in items) + queue.policy.window_s
        if not self.deadline_aware:
            return close
        # Slack: start early enough that the most pressing request can still finish in time.
        return min(close, min(self.latest_start(p) for p in items))

    def latest_start(self, item: Pending) -> float:
        """The last moment to start `item` and still finish by its deadline, with a safety margin
        (estimates are averages; a start this late must not depend on them being exact)."""
        return item.deadline - SLACK_FACTOR * self.service.estimate(item) - SLACK_MARGIN_S

    def urgency(self, queue: LaneQueue, now: float) -> tuple[int, int, float]:
        """Lower is more urgent: (head priority, 0 if out of slack else 1, overdue time or -waited windows)."""
        head = queue.peek()
        oldest = queue.oldest_arrival()
        if head is None or oldest is None:
            return (1 << 30, 1, float("inf"))
        if not self.deadline_aware:
            return 0, 1, oldest
        latest = min(self.latest_start(p) for p in queue.items() if p.rank == head.rank)
        if latest <= now:
            return head.rank, 0, latest
        return head.rank, 1, -self.aging * (now - oldest) / max(queue.policy.window_s, 1e-3)

    @property
    def shares_apply(self) -> bool:
        """Whether some lane is held to a share of the rows (then `plan` needs rows running per lane)."""
        return bool(self.total_rows) and any(q.policy.max_share < 1.0 for q in self.queues.values())

    def lane_rows(self, queue: LaneQueue, free_rows: int, running: Mapping[str, int]) -> int:
        """Rows this lane may take now: the free rows, within its share of the running batch."""
        share = queue.policy.max_share
        if share >= 1.0 or not self.total_rows:
            return free_rows
        cap = max(1, int(share * self.total_rows))
        return min(free_rows, cap - running.get(queue.policy.name, 0))

    def plan(self, now: float, free_rows: int, preemptible: int = 0,
             running: Mapping[str, int] | None = None) -> Plan:
        """`preemptible`: running batch-priority rows the caller could give back if asked; `running`:
        rows running per lane (for lane shares)."""
        running = running or {}
        plan = Plan()
        if self.deadline_aware:
            for queue in self.queues.values():
                plan.expired.extend(queue.pop_expired(now, self.service))
        if free_rows <= 0:
            if self.deadline_aware and preemptible:
                plan.preempt = min(preemptible, self._urgent_interactive_rows(now))
            return plan
        ready: list[LaneQueue] = []
        wake: list[float] = []
        rows = {name: self.lane_rows(q, free_rows, running) for name, q in self.queues.items() if len(q)}
        for queue in self.queues.values():
            if rows.get(queue.policy.name, 0) > 0:  # a lane at its share waits, like an empty one
                at = self.ready_at(queue, now)
                if at <= now:
                    ready.append(queue)
                else:
                    wake.append(at)
        if not ready:
            plan.wake_at = min(wake, default=None)
            return plan
        lane = min(ready, key=lambda q: self.urgency(q, now))
        plan.lane = lane.policy.name
        plan.batch = self._take(lane, rows[lane.policy.name])
        return plan

    def _urgent_interactive_rows(self, now: float) -> int:
        """Rows wanted by interactive requests that cannot wait for a row to free up on its own."""
        return sum(p.size for q in self.queues.values() for p in q.items()
                   if p.rank == 0 and self.latest_start(p) <= now)

    def _take(self, queue: LaneQueue, free_rows: int) -> list[Pending]:
        batch: list[Pending] = []
        rows = 0
        width = 0
        while (head := queue.peek()) is not None:
            new_rows = rows + head.size
            new_width = max(width, head.prompt_tokens)
            if batch and (new_rows > min(free_rows, self.limits.max_batch_size)
                          or new_rows * new_width > self.limits.max_batch_tokens):
                break
            batch.append(queue.pop())
            rows, width = new_rows, new_width
        return batch
