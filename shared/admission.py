"""Admission at the gateway: will this request finish by its deadline? Pure: stats and numbers in.

Inputs are the workers' published `LaneStats` for the model (only fresh ones count; one per engine of
a worker, each listing the lanes that engine serves, so only the engines serving the request's lane are
read) and the lane's stream length. The estimate:
    start  = the lane window, plus the later of the first running row's end (`first_row_end_s`: with no row it
             may take free, from the row ends each engine publishes) and the time for the workers to drain
             the requests waiting ahead of it (`ahead_in`: those the workers start before it by (priority,
             deadline), and the entries no worker has read yet) at the measured completion rate less the
             shorter lanes' own: the scheduler starts the shorter lanes of an engine first, and while
             a request waits their arrivals keep taking that share of the rows (under overload, most
             of a medium request's wait). While the workers hold nothing back (every request they
             read has started) and have free rows for those ahead, nobody waits: the completion rate
             then measures the traffic, not what the rows can do (a burst after light traffic was
             estimated 100x too slow and refused). While no completion has been measured yet, only
             the requests that do not fit the free rows count, a whole turn of the rows (its own compute) for
             each round of rows they fill: rows started together end together;
    finish = start + its own compute (prefill of its prompt + one decode step per new token, at the
             step time measured for the current batch, plus what each row adds to a step for the rows it
             and those ahead of it add to that batch, as far as there are free rows for them).
Continuous batching always has "a free row" until memory runs out, but every row slows every step:
throughput, not rows, is what a new request waits for.
A request is refused (429 + Retry-After) when `now + ADMISSION_MARGIN x finish` passes its deadline (unless
`now + INNER_MARGIN x finish` does not and a request at least as large, with no more time, was admitted to the
lane within `CONSISTENT_S`), when it is near that line (`CONSISTENT_BAND`) and a request no larger, with no less time,
was refused for its deadline within `CONSISTENT_S` (decisions do not flap while the queue moves), or when its
lane's backlog is at the cap. Without fresh stats (no worker alive) it is accepted up
to the backlog cap, and the response says there was no estimate.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.deadlines import cannot_finish
from shared.messages import LaneStat, LaneStats

STATS_MAX_AGE_MS = 5_000
# A request is admitted only if its deadline leaves this much room over the estimated finish. The estimate is a
# forecast (the queue ahead drains at a measured rate, each token at the measured interval) and a refusal at submit
# is the better mistake: the caller may retry elsewhere at once, where an admitted request that then expires in the
# queue has lost its time (docs/scheduling.md, Admission, has the measurements).
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
    # admitted inside the margin (within `INNER_MARGIN`), only because a request at least as large was admitted
    # lately (`CONSISTENT_S`)
    within_margin: bool = False
    # False: the request's own compute, at the speed measured now, does not fit before its deadline, with no queue
    # at all; a retry of the same request would be refused the same way (the caller must allow it more time)
    retryable: bool = True


# Admission's decisions near the line stay consistent for this many seconds: the queue moves between two submits a
# second apart, and a request was refused while a larger one admitted a moment before or after it finished in time
# (under the mixed overload, 0.3-2.2% of all requests). Per process and lane:
# - a request no larger (prompt and output tokens), with no less time to its deadline, than one admitted within this
#   window is not refused for the margin alone: it is admitted if its estimate meets its deadline with
#   `INNER_MARGIN`; so admitted, it counts as an admission in turn (the line stays where the last admissions put
#   it while the queue drifts), and however long such a chain runs it keeps the inner margin;
# - a request no smaller, with no more time, than one refused for its deadline within this window (and within
#   `REFUSAL_SHARE` of its time budget: with 3 s deadlines the queue turns over in less than 3 s) is refused too,
#   while its own estimate is within `CONSISTENT_BAND` of its deadline (nearer the line than the margin's double).
CONSISTENT_S = 3.0
CONSISTENT_BAND = 1.3
INNER_MARGIN = 1.05
REFUSAL_SHARE = 0.05  # of a request's time budget: how far back a refusal still holds for it (3 s at a minute)
# Time budgets within this of each other count as the same (two requests with one timeout, submitted a moment apart,
# have budgets a few milliseconds apart; the comparison is about a request given less time, not about jitter).
BUDGET_SLACK_S = 0.25


@dataclass(slots=True)
class RecentAdmits:
    """The sizes and time budgets of what a process decided for one lane lately (`CONSISTENT_S`), admitted or
    refused (one instance each); clock passed in."""
    window_s: float = CONSISTENT_S
    # (decided at, prompt tokens, new tokens, seconds it had to its deadline)
    entries: deque[tuple[float, int, int, float]] = field(default_factory=deque)

    def note(self, now_s: float, prompt_tokens: int, new_tokens: int, budget_s: float = math.inf) -> None:
        self.entries.append((now_s, prompt_tokens, new_tokens, budget_s))
        self._prune(now_s)

    def covers(self, now_s: float, prompt_tokens: int, new_tokens: int, budget_s: float = math.inf) -> bool:
        """Whether a request at least as large (prompt and output), with no more time, was noted in the window."""
        self._prune(now_s)
        return any(p >= prompt_tokens and n >= new_tokens and b <= budget_s + BUDGET_SLACK_S
                   for _, p, n, b in self.entries)

    def below(self, now_s: float, prompt_tokens: int, new_tokens: int, budget_s: float = 0.0) -> bool:
        """Whether a request no larger (prompt and output), with no less time, was noted in the window, or within
        `REFUSAL_SHARE` of this request's time budget if that is shorter (a refusal a whole deadline ago says
        nothing about a queue that has turned over since)."""
        self._prune(now_s)
        since = now_s - min(self.window_s, REFUSAL_SHARE * budget_s)
        return any(t >= since and p <= prompt_tokens and n <= new_tokens and b >= budget_s - BUDGET_SLACK_S
                   for t, p, n, b in self.entries)

    def _prune(self, now_s: float) -> None:
        while self.entries and now_s - self.entries[0][0] > self.window_s:
            self.entries.popleft()


# A lane behind shorter ones drains at what their arrivals leave it, but never counted below this share of the rows'
# rate (were the shorter lanes to take them all, their requests still start a longer lane's out of slack first).
MIN_DRAIN_SHARE = 0.1


def fresh(stats: Iterable[LaneStats], now_ms: int, max_age_ms: int = STATS_MAX_AGE_MS) -> list[LaneStats]:
    return [s for s in stats if now_ms - s.at_ms <= max_age_ms]


def serving(stats: list[LaneStats], lane: str) -> list[LaneStats]:
    """The stats of the engines that serve `lane` (all of them when none lists it: an older worker)."""
    mine = [s for s in stats if any(ln.lane == lane for ln in s.lanes)]
    return mine or stats


def shorter_rate(stats: list[LaneStats], lane: str) -> float:
    """Completions per second of the lanes an engine lists before `lane`: the share of its rows that its shorter
    lanes, started first, take (while they keep up, their completions are their arrivals)."""
    total = 0.0
    for s in stats:
        names = [ln.lane for ln in s.lanes]
        if lane in names:
            total += sum(ln.completed_rps for ln in s.lanes[:names.index(lane)])
    return total


def lane_rows(max_rows: int, max_share: float) -> int:
    """The rows a lane held to `max_share` of an engine's may run at once (as the worker's dynamic stage holds it)."""
    return max(1, int(max_share * max_rows)) if max_share < 1.0 else max_rows


def lane_free(s: LaneStats, lane: str, max_share: float) -> int:
    """The engine's free rows this lane may take: within its share, less its own running rows."""
    running = sum(ln.running for ln in s.lanes if ln.lane == lane)
    return max(0, min(s.free_rows, lane_rows(s.max_rows, max_share) - running)) if max_share < 1.0 else s.free_rows


def joining_rows(s: LaneStats, joining: int) -> int:
    """The rows an engine runs once `joining` requests start on it (as far as it has free rows for them), beyond
    those its published step time was measured at (its running rows, at least one)."""
    rows = sum(ln.running for ln in s.lanes)
    return max(0, rows + min(joining, s.free_rows) - max(1, rows))


def ahead_in(ln: LaneStat, key: tuple[int, int] | None) -> int:
    """How many of the requests an engine holds waiting in a lane start before one with `key` (rank, deadline ms):
    those with a smaller or equal key in the order it published (each sample standing for its share of them), or
    all of them where it published none or the request's key is unknown."""
    if key is None or not ln.order or ln.waiting <= 0:
        return max(0, ln.waiting)
    before = bisect.bisect_right(ln.order, key)
    return round(ln.waiting * before / len(ln.order))


def at_share(s: LaneStats, lane: str, max_share: float) -> bool:
    """Whether the lane runs all the rows of the engine its share allows: another row of any lane is not its."""
    return max_share < 1.0 and sum(ln.running for ln in s.lanes if ln.lane == lane) >= lane_rows(s.max_rows,
                                                                                                  max_share)


def first_row_end_s(stats: list[LaneStats], lane: str, max_share: float, now_ms: int | None) -> float:
    """Seconds until the first running row this lane may take the place of ends: any row of an engine where the
    lane is within its share, only its own rows where it holds all of that share. From the row ends each engine
    published (less the time since); 0 where none were (an older worker)."""
    soonest = math.inf
    for s in stats:
        age_ms = max(0, now_ms - s.at_ms) if now_ms is not None else 0
        for ln in [ln for ln in s.lanes if ln.lane == lane] if at_share(s, lane, max_share) else s.lanes:
            if ln.frees_ms:
                soonest = min(soonest, max(0.0, (ln.frees_ms[0] - age_ms) / 1000))
    return 0.0 if soonest == math.inf else soonest


def estimate(stats: list[LaneStats], lane: str, queued: int, prompt_tokens: int, new_tokens: int,
             window_s: float, max_share: float = 1.0, *, key: tuple[int, int] | None = None,
             now_ms: int | None = None) -> Estimate:
    """`queued`: entries already in the lane's stream (waiting or running) before this request; `max_share`: the
    share of an engine's rows the lane may hold (a free row it may not take starts nothing of it); `key`: the
    request's (priority rank, deadline ms), the order workers start waiting requests in (None: after all of them);
    `now_ms`: the clock the stats' `at_ms` are on (how far their row ends have come since)."""
    everyone, stats = stats, serving(stats, lane)
    if not stats:
        return Estimate(0.0, 0.0, "none")
    # costs from the engines serving the lane (before their first measurement, what their warm-up timed); zeros (an
    # older worker's engine that has run nothing) would promise any deadline: the model's other engines' stand in
    costs = [s for s in stats if s.decode_ms_per_step > 0] or [s for s in everyone if s.decode_ms_per_step > 0] \
        or stats
    running = sum(ln.running for s in stats for ln in s.lanes if ln.lane == lane)
    # the lane's entries not running, less those the workers hold that their order starts after it (the stream's
    # length is read fresh, the workers' figures up to a second old: what they hold beyond it is not counted)
    behind = sum(max(0, ln.waiting) - ahead_in(ln, key) for s in stats for ln in s.lanes if ln.lane == lane)
    ahead = max(0, queued - running - behind)
    prefill = max(s.prefill_fixed_ms + s.prefill_ms_per_token * prompt_tokens for s in costs) / 1000
    # every row slows every step (where rows cost: a CPU): the step the request's tokens take is the one of the rows
    # running then, those ahead of it and itself among them as far as there are free rows (a burst at an idle worker
    # was admitted at the one-row step, and its requests then could not all finish: evicted, or expired in the queue)
    share = -(-(ahead + 1) // len(costs))
    decode = max(s.decode_ms_per_step + s.decode_ms_per_row * joining_rows(s, share) for s in costs) / 1000 * new_tokens
    service = prefill + decode
    measured = sum(ln.completed_rps for s in stats for ln in s.lanes)
    free = sum(lane_free(s, lane, max_share) for s in stats)
    # requests a worker has read and not started: it holds them back (rows busy, or more rows would slow running
    # ones past their deadlines), so what frees room for them is throughput, not rows
    held = sum(ln.waiting for s in stats for ln in s.lanes)
    wait = 0.0
    if measured > 0 and (held or ahead >= free):
        # the rows free up at the measured rate, and the shorter lanes' new arrivals take their share of them first
        wait = ahead / max(measured - shorter_rate(stats, lane), MIN_DRAIN_SHARE * measured)
    elif ahead >= free:
        # no completion measured yet (a fresh worker): the rows started together end together, so the requests
        # beyond the free rows wait whole turns of the rows, at its own compute, not a share of one (the fifth of a
        # burst at 4 idle rows was promised a quarter of a turn and expired: an outside probe, 4 of 4)
        rows = max(1, sum(lane_rows(s.max_rows, max_share) for s in stats))
        wait = math.ceil((ahead - free + 1) / rows) * service
    # else the workers start everything they read and have rows for those ahead: a burst after light traffic,
    # whose measured rate is the light traffic's arrivals, not what the rows can do.
    # And nothing starts before a row is there for it: with no row it may take free for it and those ahead (or the
    # workers holding requests back), not before the first running row it may take the place of ends. Only the
    # first: the rows started after it (a later request's can be shorter) end in an order no one knows, and the
    # measured rate says how fast they turn over (a wait counted to the k-th row end was twice the measured one
    # under overload, and refused requests that finished in time). An interactive request that cannot wait takes a
    # batch-priority row (`preemptible`: the scheduler preempts one) instead
    usable = 0 if held else free
    if key is not None and key[0] == 0:  # where the lane may take another row
        usable += sum(s.preemptible for s in stats if not at_share(s, lane, max_share))
        if ahead < usable:  # a row for it and for the interactive requests ahead of it, free or taken: no drain
            wait = 0.0
    if ahead + 1 > usable:
        wait = max(wait, first_row_end_s(stats, lane, max_share, now_ms))
    start = window_s + wait
    return Estimate(start, start + service, "stats")


def near_line(*, now_s: float, deadline_s: float, est: Estimate) -> bool:
    """Whether `decide` can turn on what was decided for the lane lately (`larger_admitted`, `smaller_refused`): a
    measured estimate that, stretched by the margin or the consistency band, reaches the deadline. Elsewhere the
    caller need not look (a look scans the lane's last `CONSISTENT_S` of decisions: thousands under load)."""
    return est.basis == "stats" and cannot_finish(deadline_s, now_s,
                                                  max(ADMISSION_MARGIN, CONSISTENT_BAND) * est.finish_s)


def decide(*, now_s: float, deadline_s: float, est: Estimate, queued: int, max_backlog: int,
           deadline_aware: bool = True, larger_admitted: bool = False, smaller_refused: bool = False) -> Decision:
    """`larger_admitted`: a request at least as large, with no more time, was admitted to the lane within
    `CONSISTENT_S`; `smaller_refused`: one no larger, with no less time, was refused for its deadline then."""
    if queued >= max_backlog:
        wait = est.start_s if est.basis == "stats" else 1.0
        return Decision(False, est, f"lane backlog is full ({queued} >= {max_backlog} requests)", "backlog_full",
                        max(1.0, wait), queued)
    if not deadline_aware or est.basis != "stats":
        return Decision(True, est, queued=queued)
    if cannot_finish(deadline_s, now_s, ADMISSION_MARGIN * est.finish_s):
        inner = not cannot_finish(deadline_s, now_s, INNER_MARGIN * est.finish_s)
        if larger_admitted and not smaller_refused and inner:
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
    if smaller_refused and cannot_finish(deadline_s, now_s, CONSISTENT_BAND * est.finish_s):
        reason = (f"deadline infeasible: estimated finish in {est.finish_s * 1000:.0f} ms, deadline in "
                  f"{(deadline_s - now_s) * 1000:.0f} ms; a request no larger and with no less time was refused "
                  f"within the last {CONSISTENT_S:.0f} s, and admission stays consistent while the queue moves")
        return Decision(False, est, reason, "deadline_infeasible", max(1.0, math.ceil(est.start_s)), queued)
    return Decision(True, est, queued=queued)
