"""The dynamic stage of the scheduler, pure: when a lane's window closes, which ready lane goes first, how
many rows a lane may take, and which waiting requests form its batch (within the rows, the batch size and
the token budgets). `gpu_worker.scheduler.Scheduler` adds the decisions about running rows on top.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_worker.job import Job
from gpu_worker.lane_queue import LaneQueue
from gpu_worker.service_model import ServiceModel
from shared.admission import lane_rows

SLACK_FACTOR = 1.5
SLACK_MARGIN_S = 0.02
# A lane held to `long_rows` whose oldest request has waited this long takes free rows beyond it: the model is
# saturated (the same test as `gpu_worker.engines.OVERFLOW_AFTER_S`), and a full batch is what keeps up with it.
LONG_ROWS_SPILL_S = 4.0


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch_size: int  # rows per batch
    max_batch_tokens: int  # padded prompt tokens per batch (rows x longest prompt)


class DynamicStage:
    queues: dict[str, LaneQueue]
    limits: BatchLimits
    aging: float
    service: ServiceModel
    deadline_aware: bool
    total_rows: int | None
    # batch-priority rows that may start now, and the padded prompt tokens their prefill may take in one round
    # (`gpu_worker.background_rows`, set each round); None: no bound of its own
    background_rows: int | None = None
    background_tokens: int | None = None
    # rows the lanes after the first may hold together while their queues are not backed up (None: no bound)
    long_rows: int | None = None

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

    def latest_start(self, item: Job) -> float:
        """The last moment to start `item` and still finish by its deadline, with a safety margin
        (estimates are averages; a start this late must not depend on them being exact)."""
        return item.deadline - SLACK_FACTOR * self.service.estimate(item) - SLACK_MARGIN_S

    def urgency(self, queue: LaneQueue, now: float) -> tuple[int, int, float]:
        """Lower is more urgent: (head priority, 0 if out of slack else 1, overdue time or -windows waited). The first
        (shortest) lane counts its windows from arrival; a lane after it from the start the gateway's admission
        estimated for its requests, else their arrival (`Job.due`): under a backlog a medium request is told it
        starts in tens of seconds, and while it is on that schedule, short work arriving meanwhile goes first
        instead of waiting a share of its wait; work that falls behind its estimate ages like any other, so none
        starves. (Counting the short lane from its own estimates too let a short request whose estimate included a
        little queue wait out long prefills at 70% load: its p99 in the e2e benchmark went from 0.8x to 1.8x FIFO.)"""
        head = queue.peek()
        since = queue.oldest_arrival() if not self.deadline_aware or self.is_first(queue) else queue.earliest_due()
        if head is None or since is None:
            return (1 << 30, 1, float("inf"))
        if not self.deadline_aware:
            return 0, 1, since
        latest = min(self.latest_start(p) for p in queue.items() if p.rank == head.rank)
        if latest <= now:
            return head.rank, 0, latest
        return head.rank, 1, -self.aging * (now - since) / max(queue.policy.window_s, 1e-3)

    def is_first(self, queue: LaneQueue) -> bool:
        """Whether `queue` is the first (shortest) lane's."""
        return queue is next(iter(self.queues.values()))

    @property
    def shares_apply(self) -> bool:
        """Whether some lane is held to a share of the rows (then `plan` needs rows running per lane)."""
        return self.long_rows is not None or (
            bool(self.total_rows) and any(q.policy.max_share < 1.0 for q in self.queues.values()))

    def lane_rows(self, queue: LaneQueue, free_rows: int, running: Mapping[str, int], now: float) -> int:
        """Rows this lane may take now: the free rows, within its share of the running batch and, for a lane after
        the first, within `long_rows` (`held_to_long_rows`)."""
        rows = free_rows
        share = queue.policy.max_share
        if share < 1.0 and self.total_rows:
            rows = min(rows, lane_rows(self.total_rows, share) - running.get(queue.policy.name, 0))
        if self.long_rows is not None:  # the queue scan of `held_to_long_rows` only when the bound would bind
            first = next(iter(self.queues))
            room = self.long_rows - sum(n for lane, n in running.items() if lane != first)
            if room < rows and self.held_to_long_rows(queue, now):
                rows = room
        return rows

    def held_to_long_rows(self, queue: LaneQueue, now: float) -> bool:
        """Whether this lane's new rows count against `long_rows`: it is not the first (shortest) lane, and its
        queue is not backed up: its oldest request has waited less than LONG_ROWS_SPILL_S and, deadline-aware, its
        head is not out of slack. On a CPU every row makes every decode step slower (~20 ms up to 8 rows, 32 ms at
        16 on the 2-core VM), and a short request pays each step for its every token; held to a few rows, longer
        work leaves the short rows steps near their own cost. A backed-up queue takes the free rows, so a
        saturated model still runs a full batch (measured, it still cost some capacity: docs/scheduling.md)."""
        if self.is_first(queue):
            return False
        oldest, head = queue.oldest_arrival(), queue.peek()
        if oldest is None or head is None or now - oldest >= LONG_ROWS_SPILL_S:
            return False
        return not (self.deadline_aware and self.latest_start(head) <= now)  # the head: the earliest deadline

    def _take(self, queue: LaneQueue, free_rows: int, token_cap: int | None = None) -> list[Job]:
        """The lane's batch: its requests in order while the rows, the batch size and the padded prompt tokens
        (the batch limit, or `token_cap` when a step's prefill budget is smaller, or `background_tokens` for
        batch-priority work) allow, all of one priority; the head always."""
        cap = min(self.limits.max_batch_tokens, token_cap or self.limits.max_batch_tokens)
        first = queue.peek()
        if first is not None and first.rank > 0 and self.background_tokens:
            cap = min(cap, self.background_tokens)
        batch: list[Job] = []
        rows = background = 0
        width = 0
        while (head := queue.peek()) is not None and not self.background_full(head, background):
            if batch and self.deadline_aware and head.rank != batch[0].rank:  # never prefilled with batch work
                break
            new_rows = rows + head.size
            new_width = max(width, head.prompt_tokens)
            if batch and (new_rows > min(free_rows, self.limits.max_batch_size)
                          or new_rows * new_width > cap):
                break
            batch.append(queue.pop())
            rows, width = new_rows, new_width
            background += head.size if head.rank > 0 else 0
        return batch

    def background_full(self, head: Job | None, taken: int = 0) -> bool:
        """`head` is batch-priority work and may not start now beside the `taken` rows of such work."""
        cap = self.background_rows
        return head is not None and head.rank > 0 and cap is not None and taken + head.size > cap
