"""Whether running rows keep their deadlines, pure: the scheduler's judgement of the rows it has started.

A row with `n` tokens left needs its next step in full, at `NEXT_STEP_MARGIN` times the moment's token
interval (the step it is about to take; steps vary, and a row one step from its deadline is stepped only if
the step has room to run long), and `n - 1` more after it, counted at `DOOM_OPTIMISM` of the interval it is
judged at (the better of the moment's and the averaged one: `ServiceTracker.doom_step_seconds`), so that an
estimate's noise over many steps does not condemn a row that would finish. Counting the last step at 80% too
let a row with one token left and 25 ms to go take a 28 ms step and finish past its deadline, as a success:
compute past the deadline. Until the decode fit has seen `WARM_SAMPLES` steps, only the next step is judged
(`_judged`): a fit of a step or two extrapolates proportionally, and eviction is final.

New rows slow every step (`room`), and a turn that starts new work prefills it before the running rows' next
step, so they wait that prefill out (up to a chunked prefill's budget, 512 prompt tokens by default: a few decode
steps). `stalled` says whether such a stall would push a row that can finish by its deadline past it; the new
work then starts a step later, unless that step would cost it its own last chance to start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from gpu_worker.job import Job
from gpu_worker.service_model import WARM_SAMPLES, ServiceTracker
from shared.deadlines import cannot_finish

# A row's tokens after its next one are counted at this share of the interval it is judged at.
DOOM_OPTIMISM = 0.8
# Its next step at this multiple of the moment's interval (an echo model's 28 ms steps on a loaded 2-core machine
# ran up to 3 ms past their estimate: a row stepped with 2 ms to spare finished past its deadline).
NEXT_STEP_MARGIN = 1.5


def finish_work_s(tokens_left: int, next_step_s: float, interval_s: float) -> float:
    """Seconds of compute a running row still needs: its next step with a margin, the rest at the optimism factor."""
    if tokens_left <= 0:
        return 0.0
    return NEXT_STEP_MARGIN * max(0.0, next_step_s) + DOOM_OPTIMISM * (tokens_left - 1) * max(0.0, interval_s)


def _intervals(running: Mapping[str, Job], tracker: ServiceTracker) -> tuple[float, float]:
    """(the next step's seconds, the interval a row's later tokens are judged at)."""
    rows = max(1, len(running))
    return tracker.step_seconds(rows), tracker.doom_step_seconds(rows)


def unfinishable(running: Mapping[str, Job], left: Mapping[str, int], now: float,
                 tracker: ServiceTracker, *, waiting: bool = True) -> list[Job]:
    """The running rows to evict because they cannot finish by their deadline: they leave, partial output kept,
    instead of taking rows and steps from work that can, while work is `waiting` for rows. Every row slows every
    step, so a row that cannot finish beside all the others may beside fewer: the rows kept are the most that can
    each finish beside one another (`keepable`). With nothing waiting, a row that cannot finish steps on, its output
    growing, until its next step would end past its deadline: "cannot finish" counts every token up to its
    `max_new_tokens`, where most generations stop sooner, and its row is wanted by no one (10 sampled rows of 128
    tokens with 2 s deadlines were evicted together after 7 tokens on an idle worker, where they would have made 124
    each by their deadline; evicting three so that seven might finish ended those seven cut short too, at 119).

    Until the decode fit is warm, only the next step is judged: a fit of a step or two extrapolates
    proportionally (one 200 ms step of one row read as 600 ms a token for three), and eviction is final (CI:
    three echo rows with 40 s of work and 59 s left were evicted after two steps)."""
    rows = {rid: (job, n) for rid, n in left.items() if (job := running.get(rid)) is not None}
    at_all = _finishable(rows, len(running), now, tracker)
    if len(at_all) == len(rows):
        return []
    if not waiting:  # only the rows out of time: their next step would end past their deadline
        step = tracker.step_seconds(max(1, len(running)))
        return [job for job, _ in rows.values() if cannot_finish(job.deadline, now, finish_work_s(1, step, 0.0))]
    keep = keepable(rows, len(running), at_all, now, tracker)
    return [job for rid, (job, _) in rows.items() if rid not in keep]


def keepable(rows: Mapping[str, tuple[Job, int]], n: int, at_all: set[str], now: float,
             tracker: ServiceTracker) -> set[str]:
    """The most rows that can each finish by its deadline beside one another: the largest `k` at which `k` rows can
    finish at the token interval of `k` rows (found by halving: the more rows, the fewer can finish), then those that
    finish beside all `n` rows first (`at_all`), then those with the fewest tokens left."""
    m = len(at_all)
    k = m + _most(n - 1 - m, lambda j: len(_finishable(rows, m + j, now, tracker)) >= m + j)
    order = sorted(_finishable(rows, k, now, tracker),
                   key=lambda rid: (rid not in at_all, rows[rid][1], rows[rid][0].deadline))
    return set(order[:max(k, m)])


def _finishable(rows: Mapping[str, tuple[Job, int]], k: int, now: float, tracker: ServiceTracker) -> set[str]:
    """The rows that can finish by their deadline while `k` rows run."""
    step, interval = tracker.step_seconds(max(1, k)), tracker.doom_step_seconds(max(1, k))
    return {rid for rid, (job, n) in rows.items()
            if not cannot_finish(job.deadline, now, finish_work_s(_judged(n, tracker), step, interval))}


def _judged(tokens_left: int, tracker: ServiceTracker) -> int:
    """The tokens of a row's remaining work that are judged: all once the decode fit is warm, else the next one."""
    return tokens_left if tracker.decode.n >= WARM_SAMPLES else min(tokens_left, 1)


def room(running: Mapping[str, Job], left: Mapping[str, int], now: float, tracker: ServiceTracker,
         limit: int) -> int:
    """Rows that may join without pushing a running row past its deadline: every row slows every step, and each
    running row must still fit its remaining tokens into the time it has left. Under overload, admitting past
    this point starts work that is then evicted unfinished (its compute wasted, and everyone slowed while it ran)."""
    budgets = [(job.deadline - now) / n for rid, n in left.items() if n > 0 and (job := running.get(rid)) is not None]
    if not budgets:
        return limit
    return max(0, tracker.rows_within(min(budgets), limit) - len(left))


def stalled(running: Mapping[str, Job], left: Mapping[str, int], now: float, tracker: ServiceTracker,
            batch: list[Job], latest_start: Callable[[Job], float]) -> bool:
    """Whether prefilling `batch` now pushes past its deadline a running row that would finish by it otherwise,
    while the batch can as well start a step later (none of it is at its last chance to start)."""
    if not batch or not left or tracker.prefill.n == 0:
        return False
    step, interval = _intervals(running, tracker)
    if any(latest_start(j) <= now + step for j in batch):
        return False
    stall = tracker.prefill.predict(sum(j.size for j in batch) * max(j.prompt_tokens for j in batch))
    for rid, n in left.items():
        job, work = running.get(rid), finish_work_s(_judged(n, tracker), step, interval)
        if job is not None and work > 0 and not cannot_finish(job.deadline, now, work) \
                and cannot_finish(job.deadline, now, work + stall):
            return True
    return False


def _most(limit: int, holds: Callable[[int], bool]) -> int:
    """The largest `j` in 0..`limit` for which `holds(j)`, which holds up to some `j` and not past it (by halving)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid - 1)
    return lo
