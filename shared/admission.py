"""Admission at the gateway: will this request finish by its deadline? Pure: stats and numbers in.

Inputs are the workers' published `LaneStats` for the model (only fresh ones count; one per engine of
a worker, each listing the lanes that engine serves, so only the engines serving the request's lane are
read) and the lane's stream length. The estimate:
    start  = the lane window, plus the time for the workers to drain the requests waiting ahead of
             it at their measured completion rate (while no completion has been measured yet, only
             the requests that do not fit the free rows count, at what the rows could do); ahead of
             it are its own lane's entries not yet running and the requests waiting in the shorter
             lanes of the same engines (which the scheduler starts first);
    finish = start + its own compute (prefill of its prompt + one decode step per new token, at the
             step time measured for the current batch).
Continuous batching always has "a free row" until memory runs out, but every row slows every step:
throughput, not rows, is what a new request waits for.
A request is refused (429 + Retry-After) when `now + ADMISSION_MARGIN x finish` passes its deadline (unless
`now + finish` does not and a request at least as large was admitted to the lane within
`CONSISTENT_S`) or its lane's backlog is at the cap. Without fresh stats (no worker alive) it is accepted up
to the backlog cap, and the response says there was no estimate.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.deadlines import cannot_finish
from shared.messages import LaneStats

STATS_MAX_AGE_MS = 5_000
# A request is admitted only if its deadline leaves this much room over the estimated finish. The estimate is a
# forecast (the queue ahead drains at a measured rate, each token at the measured interval); under a mixed
# overload 2.7% of the requests admitted on the bare estimate expired in the queue without compute, while the
# requests that did run finished within 1.12x of their estimate at the 90th percentile. A refusal at submit is
# the better answer (the caller may retry elsewhere at once). Measured on the mixed overload (one run each):
# 10% left 1.3% admitted-then-expired and refused 0.5% that a comparable request beside them shows would have
# made it; 15% 0% and 1.4%; 20% 0% and 1.6%.
ADMISSION_MARGIN = 1.15


@dataclass(frozen=True, slots=True)
class Estimate:
    start_s: float
    finish_s: float
    basis: str  # "stats" | "none"


@dataclass(frozen=True, slots=True)
class Decision:
    accept: bool
    estimate: Estimate
    reason: str = ""
    code: str = ""
    retry_after_s: float | None = None
    queued: int = 0  # the lane's stream length it was decided on (the request's queue position is one more)
    # admitted inside the margin, only because a request at least as large was admitted lately (`CONSISTENT_S`);
    # such an admission does not itself count as one (no chain of them keeps the margin off)
    within_margin: bool = False
    # False: the request's own compute, at the speed measured now, does not fit before its deadline, with no queue
    # at all; a retry of the same request would be refused the same way (the caller must allow it more time)
    retryable: bool = True


# A refusal for the margin alone is not given to a request no larger (prompt and output tokens) than one this process
# admitted to the same lane within this many seconds, provided the estimate meets its deadline without the margin.
# The queue moves between two submits a second apart; without this rule a request was refused while a larger one
# admitted a moment before it finished in time (under the mixed overload, 0.3-2.2% of all requests).
CONSISTENT_S = 3.0


@dataclass(slots=True)
class RecentAdmits:
    """The sizes of what a process admitted to one lane lately (`CONSISTENT_S`); clock passed in."""
    window_s: float = CONSISTENT_S
    entries: deque[tuple[float, int, int]] = field(default_factory=deque)  # (admitted at, prompt, new tokens)

    def note(self, now_s: float, prompt_tokens: int, new_tokens: int) -> None:
        self.entries.append((now_s, prompt_tokens, new_tokens))
        self._prune(now_s)

    def covers(self, now_s: float, prompt_tokens: int, new_tokens: int) -> bool:
        """Whether a request at least as large (prompt and output) was admitted within the window."""
        self._prune(now_s)
        return any(p >= prompt_tokens and n >= new_tokens for _, p, n in self.entries)

    def _prune(self, now_s: float) -> None:
        while self.entries and now_s - self.entries[0][0] > self.window_s:
            self.entries.popleft()


def fresh(stats: Iterable[LaneStats], now_ms: int, max_age_ms: int = STATS_MAX_AGE_MS) -> list[LaneStats]:
    return [s for s in stats if now_ms - s.at_ms <= max_age_ms]


def serving(stats: list[LaneStats], lane: str) -> list[LaneStats]:
    """The stats of the engines that serve `lane` (all of them when none lists it: an older worker)."""
    mine = [s for s in stats if any(ln.lane == lane for ln in s.lanes)]
    return mine or stats


def shorter_waiting(stats: list[LaneStats], lane: str) -> int:
    """Requests waiting in the lanes an engine lists before `lane` (its shorter lanes, started first)."""
    total = 0
    for s in stats:
        names = [ln.lane for ln in s.lanes]
        if lane in names:
            total += sum(ln.waiting for ln in s.lanes[:names.index(lane)])
    return total


def drain_rate(stats: list[LaneStats], service_s: float) -> float:
    """Requests per second the workers finish: measured, else what their rows could do."""
    measured = sum(lane.completed_rps for s in stats for lane in s.lanes)
    capacity = sum(s.max_rows for s in stats) / max(service_s, 1e-3)
    return measured if measured > 0 else capacity


def estimate(stats: list[LaneStats], lane: str, queued: int, prompt_tokens: int, new_tokens: int,
             window_s: float) -> Estimate:
    """`queued`: entries already in the lane's stream (waiting or running) before this request."""
    everyone, stats = stats, serving(stats, lane)
    if not stats:
        return Estimate(0.0, 0.0, "none")
    # costs from the engines serving the lane; one that has run nothing yet has measured nothing, and its
    # zeros would promise any deadline: then the costs the model's other engines measured stand in
    costs = [s for s in stats if s.decode_ms_per_step > 0] or [s for s in everyone if s.decode_ms_per_step > 0] \
        or stats
    prefill = max(s.prefill_fixed_ms + s.prefill_ms_per_token * prompt_tokens for s in costs) / 1000
    decode = max(s.decode_ms_per_step for s in costs) / 1000 * new_tokens
    service = prefill + decode
    running = sum(ln.running for s in stats for ln in s.lanes if ln.lane == lane)
    ahead = max(0, queued - running) + shorter_waiting(stats, lane)
    measured = sum(ln.completed_rps for s in stats for ln in s.lanes)
    start = window_s
    if measured > 0:
        start += ahead / measured
    else:
        free = sum(s.free_rows for s in stats)
        if ahead >= free:
            start += (ahead - free + 1) / drain_rate(stats, service)
    return Estimate(start, start + service, "stats")


def decide(*, now_s: float, deadline_s: float, est: Estimate, queued: int, max_backlog: int,
           deadline_aware: bool = True, larger_admitted: bool = False) -> Decision:
    """`larger_admitted`: a request at least as large was admitted to the lane within `CONSISTENT_S`."""
    if queued >= max_backlog:
        wait = est.start_s if est.basis == "stats" else 1.0
        return Decision(False, est, f"lane backlog is full ({queued} >= {max_backlog} requests)", "backlog_full",
                        max(1.0, wait), queued)
    if deadline_aware and est.basis == "stats" and cannot_finish(deadline_s, now_s, ADMISSION_MARGIN * est.finish_s):
        if larger_admitted and not cannot_finish(deadline_s, now_s, est.finish_s):
            return Decision(True, est, queued=queued, within_margin=True)
        budget_ms = (deadline_s - now_s) * 1000
        compute_ms = (est.finish_s - est.start_s) * 1000
        if compute_ms > budget_ms:
            reason = (f"deadline infeasible: this request needs about {compute_ms:.0f} ms of compute and its "
                      f"deadline is {budget_ms:.0f} ms away (admission keeps a {ADMISSION_MARGIN - 1:.0%} margin)")
        else:
            reason = (f"deadline infeasible: estimated finish in {est.finish_s * 1000:.0f} ms (queue "
                      f"{est.start_s * 1000:.0f} ms + compute {compute_ms:.0f} ms), deadline in {budget_ms:.0f} ms "
                      f"(admission keeps a {ADMISSION_MARGIN - 1:.0%} margin)")
        return Decision(False, est, reason, "deadline_infeasible", max(1.0, math.ceil(est.start_s)), queued,
                        retryable=compute_ms <= budget_ms)
    return Decision(True, est, queued=queued)
