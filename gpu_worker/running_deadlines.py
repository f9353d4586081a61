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
                 tracker: ServiceTracker) -> list[Job]:
    """The running rows that cannot finish by their deadline (or are past it): they leave now, partial output
    kept, instead of taking rows and steps from work that can.

    Until the decode fit is warm, only the next step is judged: a fit of a step or two extrapolates
    proportionally (one 200 ms step of one row read as 600 ms a token for three), and eviction is final (CI:
    three echo rows with 40 s of work and 59 s left were evicted after two steps)."""
    step, interval = _intervals(running, tracker)
    return [job for rid, n in left.items() if (job := running.get(rid)) is not None
            and cannot_finish(job.deadline, now, finish_work_s(_judged(n, tracker), step, interval))]


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
