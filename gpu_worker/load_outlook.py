"""What a compute loop publishes beside its counts so that admission can place a new request where the worker will
start it, pure (clock and costs passed in):

- the order its waiting requests start in, per lane: their (priority rank, deadline) keys, sorted as the lane queue
  pops them (`waiting_order`), sampled evenly when there are many. A request is started before every waiting one
  whose key is greater than its own: an interactive request is not behind queued batch-priority work, nor one due
  sooner behind another tenant's flood due later (admission counted every waiting request as ahead of it);
- when its running rows end, per lane (`row_frees_ms`): the tokens each has left at the step time the worker
  forecasts, or its deadline where that comes first, ascending. With every row busy and nothing waiting, a new
  request starts when the first of them ends, not at once (admission counted no wait there, and admitted requests
  then expired in the queue). Where the lane's generations end by themselves before their `max_new_tokens` (a
  model's EOS: `LaneCounters.stop_share`), a row is counted to end where they usually do, until it has passed
  that (then at its `max_new_tokens`);
- how many running rows are batch-priority (`preemptible`): an interactive request that cannot wait takes one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from gpu_worker.job import Job

ORDER_SAMPLES = 64  # keys published per lane at most: the buffer a worker reads ahead is 32 or more requests
FREES_KEPT = 8  # row ends published per lane: the soonest ones (admission reads the first)


def waiting_order(jobs: Iterable[Job]) -> tuple[tuple[int, int], ...]:
    """The (rank, deadline ms) keys of a lane's waiting requests, ascending (the lane queue's order); at most
    `ORDER_SAMPLES` of them, evenly spread over the sorted keys when there are more (each then stands for its share
    of the count published beside it)."""
    keys = sorted((job.rank, int(job.deadline * 1000)) for job in jobs)
    n = len(keys)
    if n <= ORDER_SAMPLES:
        return tuple(keys)
    return tuple(keys[round(i * (n - 1) / (ORDER_SAMPLES - 1))] for i in range(ORDER_SAMPLES))


def row_frees_ms(running: Iterable[Job], left: Mapping[str, int], now: float, step_s: float,
                 stop_share: Mapping[str, float] | None = None) -> dict[str, list[int]]:
    """Per lane, the milliseconds until each of its running rows ends: the tokens it has left at `step_s` a token
    (where the lane's generations usually end sooner, `stop_share` of their `max_new_tokens`, the tokens left to
    that while it has not passed it), or its deadline where that comes first (the worker cuts it there); ascending,
    the soonest `FREES_KEPT`. A row whose tokens left are unknown (a chunked prefill's, an encoder's) counts as
    ending after its next step."""
    by_lane: dict[str, list[int]] = {}
    for job in running:
        tokens = left.get(job.id, 1)
        usual = math.ceil((stop_share or {}).get(job.lane, 1.0) * job.new_tokens) - (job.new_tokens - tokens)
        compute_s = max(1, usual if 0 < usual < tokens else tokens) * max(0.0, step_s)
        by_lane.setdefault(job.lane, []).append(int(1000 * max(0.0, min(compute_s, job.deadline - now))))
    return {lane: sorted(ends)[:FREES_KEPT] for lane, ends in by_lane.items()}


def preemptible(running: Iterable[Job]) -> int:
    """Running batch-priority rows: an interactive request that can no longer wait takes one (`Scheduler._victims`)."""
    return sum(job.size for job in running if job.rank > 0)
