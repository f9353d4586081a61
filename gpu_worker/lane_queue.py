"""The waiting requests of one lane, in the order the scheduler takes them. Pure: no torch, no Redis.

Within a lane requests are ordered by (priority, deadline): EDF within a priority; the FIFO baseline
orders them by arrival instead. Removal is lazy (a removed entry is skipped when it surfaces), so a
cancellation costs O(1) and the heap is rebuilt only when removed entries outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.job import Job
from shared.deadlines import cannot_finish

if TYPE_CHECKING:
    from gpu_worker.service_model import ServiceModel


@dataclass(frozen=True, slots=True)
class LanePolicy:
    name: str
    window_s: float
    # the largest fraction of the running batch's rows this lane may hold; below 1 the other lanes keep
    # rows of their own (long work never takes every row, so short work never queues behind it)
    max_share: float = 1.0



class LaneQueue:
    """Waiting requests of one lane, popped in (priority, deadline, arrival) order."""

    def __init__(self, policy: LanePolicy, *, fifo: bool = False) -> None:
        self.policy = policy
        self.fifo = fifo
        self._heap: list[tuple[int, float, int, Job]] = []  # (rank, deadline | arrival, seq, item)
        self._live: dict[str, Job] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def key(self, item: Job) -> tuple[int, float]:
        """What the lane starts its requests in order of: (priority rank, deadline), or arrival in FIFO mode."""
        return (0, item.arrived) if self.fifo else (item.rank, item.deadline)

    def push(self, item: Job) -> None:
        self._live[item.id] = item
        heapq.heappush(self._heap, (*self.key(item), next(self._seq), item))

    def remove(self, request_id: str) -> Job | None:
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

    def peek(self) -> Job | None:
        self._clean_top()
        return self._heap[0][3] if self._heap else None

    def pop(self) -> Job:
        self._clean_top()
        item = heapq.heappop(self._heap)[3]
        del self._live[item.id]
        return item

    def items(self) -> Iterable[Job]:
        return self._live.values()

    def oldest_arrival(self) -> float | None:
        return min((p.arrived for p in self._live.values()), default=None)

    def earliest_due(self) -> float | None:
        """The earliest expected start among the waiting requests (`Job.due`)."""
        return min((p.due for p in self._live.values()), default=None)

    def pop_expired(self, now: float, service: ServiceModel | None = None) -> list[Job]:
        """Remove requests that cannot finish in time: past the deadline, or past it once computed."""
        gone = [p for p in self._live.values()
                if cannot_finish(p.deadline, now, service.estimate(p) if service is not None else 0.0)]
        for p in gone:
            del self._live[p.id]
        if gone:
            self._compact()
        return gone
