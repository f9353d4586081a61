"""How batch-priority rows share a running batch with interactive rows. Pure: rows, a clock value and the
measured step cost in; a decision out.

Batch-priority work (the Batch API's items, or any request sent with `priority: "batch"`) runs on the
capacity interactive work leaves idle, and must not slow interactive work down. On a GPU a decode step
costs about the same for a few more rows, so batch rows ride along for free; on a CPU every row adds to
every step (about 15 ms at 1 row and 35 ms at 32 on the 2-core VM), so a running batch full of batch rows
stretches every interactive token several-fold. So, each round:
- while interactive rows run, batch rows step only as many as keep a step within `STEP_ALLOWANCE` of
  the interactive rows' own step, at the measured cost of a row (on a GPU that is all of them). The
  others sit out (`gpu_worker.parked_rows`): they keep their work and step again when the interactive
  rows are gone. A batch row whose deadline needs it steps anyway. Rows already stepping keep stepping
  before others, so rows do not churn in and out;
- for `LINGER_S` after interactive rows ran, batch rows alone step only as many as keep a step within
  `LINGER_STEP_FACTOR` of a one-row step: interactive requests come in runs, and the next one then waits for a
  short step instead of a step of every batch row (on a GPU, again, that is all of them);
- batch work prefills at most what costs about one decode step of the rows stepping per round (an
  interactive request arriving meanwhile waits no longer than for a step), never in the same forward as
  interactive prompts (`DynamicStage._take`);
- batch work starts no row while interactive rows run unless it may step, and never takes the last
  `RESERVED_SHARE` of the rows: an interactive request finds a row at once instead of waiting for a
  batch row to finish (or preempting one, which throws its work away).
Parking applies in deadline-aware mode only; the FIFO baseline ignores priorities altogether.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_worker.job import Job
from shared.deadlines import cannot_finish

if TYPE_CHECKING:
    from gpu_worker.runner import Runner
    from gpu_worker.scheduler import Scheduler

# what stepping batch rows may add to a step interactive rows decode in: about nothing (on a CPU, where a row costs
# ~4% of a one-row step, none step; on a GPU, where a step is flat in rows, all do)
STEP_ALLOWANCE = 0.03
LINGER_S = 2.0  # after interactive rows ran, batch rows alone keep steps short this long (see the module notes)
LINGER_STEP_FACTOR = 2.0  # ... within this many one-row steps
RESERVED_SHARE = 1 / 16  # of the running batch's rows, kept free of batch-priority work (none below 16 rows)
MIN_PREFILL_TOKENS = 32  # a round's batch-priority prefill may always take this many padded prompt tokens
DEADLINE_MARGIN = 2.0  # a batch row steps anyway once its tokens left, at this many intervals each, near its deadline


@dataclass(frozen=True, slots=True)
class Share:
    hold: frozenset[str]  # batch rows that sit out the next step
    start_rows: int | None  # batch-priority rows that may start now (None: only the free rows bound them)
    prefill_tokens: int | None = None  # padded prompt tokens their prefill may take this round (None: no bound)


def stepping_background(foreground: int, limit: int, step_s: Callable[[int], float], *,
                        lingering: bool = False) -> int:
    """Batch rows (up to `limit`) that may step beside `foreground` interactive rows: `limit` with none (unless
    `lingering`: interactive rows ran moments ago), or while the step cost is not measured yet (`step_s` <= 0);
    otherwise as many as keep `step_s(rows)` within the allowance (`LINGER_STEP_FACTOR` one-row steps when
    lingering)."""
    if not foreground and not lingering:
        return limit
    base = step_s(max(1, foreground))
    if base <= 0:
        return limit
    bound = (1 + STEP_ALLOWANCE) * base if foreground else LINGER_STEP_FACTOR * base
    k = 0
    while k < limit and step_s(foreground + k + 1) <= bound:
        k += 1
    return k


def prefill_tokens(step_s: float, prefill: tuple[float, float]) -> int | None:
    """Padded prompt tokens whose prefill costs about one decode step (`step_s`), at the measured prefill cost
    (`prefill`: fixed seconds, seconds per padded token); None until both are measured."""
    fixed_s, per_token_s = prefill
    if step_s <= 0 or per_token_s <= 0:
        return None
    return max(MIN_PREFILL_TOKENS, int((step_s - max(0.0, fixed_s)) / per_token_s))


def reserved_rows(total_rows: int) -> int:
    """Rows batch work never takes. A small engine reserves none: a row there is a large share of its capacity,
    and an interactive request short of time preempts a batch row instead (`Scheduler._victims`)."""
    return int(total_rows * RESERVED_SHARE)


def share(running: Iterable[Job], left: Mapping[str, int], held: Collection[str], now: float, *, total_rows: int,
          step_s: Callable[[int], float], interval_s: float, prefill: tuple[float, float] = (0.0, 0.0),
          foreground_at: float | None = None) -> Share:
    """Which batch rows sit out the next step, how many batch rows may start and how much of their prompts a
    round may prefill (`left`: tokens each running row still has to generate; `held`: rows sitting out now;
    `step_s(rows)`: a bare decode step's measured cost; `interval_s`: the measured token interval; `prefill`:
    the measured prefill cost, fixed seconds and seconds per padded token; `foreground_at`: when interactive rows
    last ran)."""
    rows = list(running)
    background = [j for j in rows if j.rank > 0]
    foreground = len(rows) - len(background)
    room = max(0, total_rows - reserved_rows(total_rows) - len(background))
    lingering = not foreground and foreground_at is not None and now - foreground_at < LINGER_S
    if not foreground and not lingering:
        return Share(frozenset(), room, prefill_tokens(step_s(max(1, len(rows))), prefill))
    allowed = stepping_background(foreground, total_rows - foreground, step_s, lingering=lingering)
    urgent = [j for j in background
              if cannot_finish(j.deadline, now, DEADLINE_MARGIN * left.get(j.id, 0) * max(0.0, interval_s))]
    urgent_ids = {j.id for j in urgent}
    others = sorted((j for j in background if j.id not in urgent_ids),
                    key=lambda j: (j.id in held, j.deadline, left.get(j.id, 0)))
    stepping = urgent + others[:max(0, allowed - len(urgent))]
    hold = frozenset(j.id for j in background) - {j.id for j in stepping}
    tokens = prefill_tokens(step_s(max(1, foreground + len(stepping))), prefill)
    return Share(hold, min(room, max(0, allowed - len(stepping))), tokens)


def widened(before: int | None, after: int | None) -> bool:
    """Whether batch-priority work may start more rows (`Share.start_rows`) after than before (None: as many as
    are free): then the loop plans again at once rather than waiting for a command."""
    return before is not None and (after is None or after > before)


@dataclass
class Sharing:
    """What `share` remembers from round to round: the batch rows sitting out, and when interactive rows last ran."""

    held: frozenset[str] = field(default_factory=frozenset)
    foreground_at: float | None = None

    def next(self, running: Iterable[Job], left: Mapping[str, int], now: float, *, total_rows: int,
             step_s: Callable[[int], float], interval_s: float, prefill: tuple[float, float] = (0.0, 0.0)) -> Share:
        """`share` for this round, with the rows held and the time interactive rows last ran remembered."""
        rows = list(running)
        if any(j.rank == 0 for j in rows):
            self.foreground_at = now
        out = share(rows, left, self.held, now, total_rows=total_rows, step_s=step_s, interval_s=interval_s,
                    prefill=prefill, foreground_at=self.foreground_at)
        self.held = out.hold
        return out

    def apply(self, scheduler: Scheduler, runner: Runner, total_rows: int, now: float) -> None:
        """`next` for a compute loop's round: its runner holds back the rows that sit out the next step; its scheduler
        learns how many batch-priority rows it may start next round, and with how many prompt tokens."""
        running, t, held = scheduler.running, scheduler.tracker, self.held
        share = self.next(running.values(), runner.remaining_tokens(), now, total_rows=total_rows,
                          interval_s=t.step_seconds(len(running)), step_s=t.bare_step_s,
                          prefill=(t.prefill.intercept, t.prefill.slope))
        if share.hold or held:
            runner.hold_back(share.hold)
        scheduler.background_rows, scheduler.background_tokens = share.start_rows, share.prefill_tokens
