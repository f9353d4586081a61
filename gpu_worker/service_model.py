"""The worker's service-time model, measured as it runs. Pure: no clock reads, no torch, no Redis.

- prefill (or encoder forward) time as a linear function of the batch's padded tokens;
- decode step time as a linear function of the running rows;
- completions per second per lane (exponentially weighted).
Until a fit has its first sample, the runner's `CostPrior` stands in for it (what its warm-up measured, an echo
model's configured costs): a fit with nothing in it predicts 0 s, and a fresh worker promised any deadline.
From these: the estimated compute time of a request (for the scheduler's slack) and the figures a
worker publishes for the gateway's admission control.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_worker.robust_line import Line, theil_sen

if TYPE_CHECKING:
    from gpu_worker.job import Job


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Estimated compute time of a request: its prefill (fixed + per padded prompt token) plus one
    decode step per new token. Measured by `ServiceTracker`."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    decode_s_per_token: float = 0.0

    def estimate(self, item: Job) -> float:
        return (self.fixed_s + self.per_token_s * item.prompt_tokens * item.size
                + self.decode_s_per_token * item.new_tokens)


# Once the fit has seen enough, a sample counts at most this many times what the fit predicts for it. A
# compute thread starved for a moment (its CPU given to a higher-priority engine, another process, a
# hypervisor's steal) measures one interval 10-100x the usual; unclipped, a few of those predicted half a
# second per token and expired or evicted long requests that finished in a quarter of their deadline. A
# real, lasting slowdown still shows: each sample can raise the estimate by a factor, and it keeps rising.
CLIP_FACTOR = 4.0
RECENT_FUSED = 16  # the fused chunks a line is drawn through (`ServiceTracker.fused_line`)
# two fused chunks tell a cost per token apart from the fixed part only when their sizes differ by this much of the
# larger: closer sizes leave a difference of costs that is mostly noise
FUSED_PAIR_SPREAD = 0.25
WARM_SAMPLES = 8  # samples before a fit clips outliers or is trusted to bound the rows


@dataclass(frozen=True, slots=True)
class CostPrior:
    """A runner's costs before anything is measured (seconds): a prefill's fixed part and cost per padded prompt token,
    a decode step's fixed part and cost per row it advances. What its warm-up measured; an echo model's, its
    configuration."""

    prefill_fixed_s: float = 0.0
    prefill_per_token_s: float = 0.0
    step_s: float = 0.0
    step_per_row_s: float = 0.0

    @classmethod
    def through(cls, short: tuple[int, float], long: tuple[int, float], step_s: float = 0.0,
                step_per_row_s: float = 0.0) -> CostPrior:
        """The prefill line through two timed prefills, (prompt tokens, seconds) each, and the decode step's line (its
        fixed part, what each row adds). A longer prompt that ran no slower (noise) leaves it flat at the slower of
        the two."""
        (n0, s0), (n1, s1) = sorted([short, long])
        per_token = max(0.0, (s1 - s0) / (n1 - n0)) if n1 > n0 else 0.0
        return cls(prefill_fixed_s=max(0.0, max(s0, s1) - per_token * n1), prefill_per_token_s=per_token,
                   step_s=max(0.0, step_s), step_per_row_s=max(0.0, step_per_row_s))


class RunningFit:
    """y ~ intercept + slope * x, over exponentially weighted moments (recent samples count most). `seed` sets the
    line it predicts until its first sample (which then replaces it whole)."""

    def __init__(self, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.n = 0
        self._mx = self._my = self._mxx = self._mxy = 0.0
        self._prior = (0.0, 0.0)  # (intercept, slope) while n == 0

    def seed(self, intercept: float, slope: float) -> None:
        self._prior = (max(0.0, intercept), max(0.0, slope))

    @property
    def prior_slope(self) -> float:
        """The slope it was seeded with (what stands in for a measured one)."""
        return self._prior[1]

    def add(self, x: float, y: float) -> None:
        if self.n >= WARM_SAMPLES and (bound := self.predict(x)) > 0:
            y = min(y, CLIP_FACTOR * bound)
        a = 1.0 if self.n == 0 else max(self.alpha, 1.0 / (self.n + 1))
        self._mx += a * (x - self._mx)
        self._my += a * (y - self._my)
        self._mxx += a * (x * x - self._mxx)
        self._mxy += a * (x * y - self._mxy)
        self.n += 1

    @property
    def slope(self) -> float:
        if self.n == 0:
            return self._prior[1]
        proportional = self._my / self._mx if self._mx > 0 else 0.0
        var = self._mxx - self._mx * self._mx
        if not self.spread:
            return proportional  # one x seen so far
        # Costs have a fixed part >= 0, so the line through the mean point can be no steeper than the
        # proportional one. Over a narrow range of x (a full batch: nearly always the same rows) the
        # least-squares slope is mostly noise: one slow iteration at one more row would otherwise
        # predict seconds per token and expire work that could finish.
        return min(max(0.0, (self._mxy - self._mx * self._my) / var), proportional)

    @property
    def spread(self) -> bool:
        """Whether its slope is measured: samples at more than one x (else it is the proportional stand-in)."""
        return self.n >= 3 and self._mxx - self._mx * self._mx > 1e-9 * max(1.0, self._mxx)

    @property
    def ratio(self) -> float:
        """y per unit of x through the origin (mean y / mean x): a cost with no fixed part."""
        return self._my / self._mx if self._mx > 0 else 0.0

    @property
    def intercept(self) -> float:
        if self.n == 0:
            return self._prior[0]
        return max(0.0, self._my - self.slope * self._mx)

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


# Completions per second are averaged with this time constant. Long generations finish in clumps seconds
# apart; averaged over ~3 s (as before), a long lane on an engine of its own read as 0.05 completions per
# second between clumps, and admission refused requests for a minute of "queue" that lasted none.
RATE_TAU_S = 10.0


@dataclass
class LaneCounters:
    completed: int = 0
    rate: float = 0.0  # completions per second, exponentially weighted
    measured: bool = False  # a first completion has set the rate
    stop_share: float = 1.0  # of max_new_tokens, what generations that ended by themselves made (`load_outlook`)


MEASURED_STEPS = 8  # bare decode steps seen before `bare_step_s` answers
STOP_SHARE_ALPHA = 0.1  # the weight of the newest generation in a lane's `stop_share`
ADMISSION_ALPHA = 0.01  # the weight of the newest token interval in the one admission forecasts with


@dataclass
class ServiceTracker:
    lanes: tuple[str, ...]
    prefill: RunningFit = field(default_factory=RunningFit)
    decode: RunningFit = field(default_factory=RunningFit)  # the token interval a running row sees, all included
    # the same, averaged over ~100 intervals (about 10 s of a full batch on a CPU) instead of ~20: what admission
    # forecasts a request's tokens at. A generation spans many seconds, and a second of slow steps (a burst of
    # prefills, the machine's hiccups) moved the published interval by 15% and the estimate of a 128-token request
    # by seconds, so admission's line jumped between two submits a moment apart
    decode_slow: RunningFit = field(default_factory=lambda: RunningFit(alpha=ADMISSION_ALPHA))
    bare: RunningFit = field(default_factory=RunningFit)  # a decode step alone (no chunk, no prefill), by rows
    # what a chunk fused into a decode step adds to it, by the chunk's tokens (bounds a hiccup's sample)
    fused: RunningFit = field(default_factory=lambda: RunningFit(alpha=0.2))
    # the last fused chunks, newest last: (prompt tokens, what the chunk added to its step); recent ones only, as the
    # cost per token grows while the chunks move along the prompt and attend to more of it
    recent_fused: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=RECENT_FUSED))
    counters: dict[str, LaneCounters] = field(default_factory=dict)
    rate_tau_s: float = RATE_TAU_S

    def __post_init__(self) -> None:
        self.counters = {lane: LaneCounters() for lane in self.lanes}

    def seed(self, prior: CostPrior) -> None:
        """What prefills and token intervals are taken to cost until the first of each is measured."""
        self.prefill.seed(prior.prefill_fixed_s, prior.prefill_per_token_s)
        for fit in (self.decode, self.decode_slow):
            fit.seed(prior.step_s, prior.step_per_row_s)

    def observe_prefill(self, padded_tokens: int, seconds: float) -> None:
        self.prefill.add(padded_tokens, seconds)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.decode.add(rows, seconds)
        self.decode_slow.add(rows, seconds)

    def observe_bare_step(self, rows: int, seconds: float) -> None:
        self.bare.add(rows, seconds)

    def observe_fused(self, tokens: int, extra_seconds: float) -> None:
        extra = max(0.0, extra_seconds)
        if self.fused.n >= WARM_SAMPLES and (bound := self.fused.predict(tokens)) > 0:
            extra = min(extra, CLIP_FACTOR * bound)  # as the fit clips it
        self.recent_fused.append((tokens, extra))
        self.fused.add(tokens, extra)

    @property
    def fused_line(self) -> Line | None:
        """A fused chunk's fixed part and cost per token, through `recent_fused` (`theil_sen`); None while their sizes
        are too alike to tell the two apart."""
        return theil_sen(self.recent_fused, FUSED_PAIR_SPREAD)

    def observe_round(self, rows: int, step_s: float, interval_s: float, chunk: int, chunk_s: float, *,
                      fused: bool, chunking: bool) -> None:
        """A round's decode step advanced `rows` rows in `step_s`, with `chunk` prompt tokens of a chunked prefill
        (`chunk_s` of them when not `fused` into it); a running row saw `interval_s` since its previous token."""
        self.decode.add(rows, interval_s)
        self.decode_slow.add(rows, interval_s)
        decoding = rows - int(chunking or chunk > 0)
        if chunk and fused and decoding > 0:  # what the chunk added to the decode step
            self.observe_fused(chunk, step_s - (self.bare.predict(decoding) if self.bare.n else 0.0))
        elif chunk:  # a chunk of prefill teaches the prefill fit too
            self.prefill.add(chunk, chunk_s)
        else:  # the decode step alone: what a fused chunk is sized against
            self.bare.add(rows, step_s)

    def bare_step_s(self, rows: int) -> float:
        """A bare decode step of `rows` rows, as measured; 0.0 until MEASURED_STEPS were seen."""
        return self.bare.predict(rows) if self.bare.n >= MEASURED_STEPS else 0.0

    def observe_completion(self, lane: str, stop_share: float | None = None) -> None:
        counters = self.counters.setdefault(lane, LaneCounters())
        counters.completed += 1
        if stop_share is not None:  # a generation that ended by itself: the share of its max_new_tokens it made
            counters.stop_share += STOP_SHARE_ALPHA * (stop_share - counters.stop_share)

    def tick(self, dt: float, busy: bool = True) -> None:
        """Fold the completions of the last `dt` seconds into each lane's rate. An idle interval (nothing
        running or waiting, nothing completed) leaves the rates as they were: they say how fast the
        worker drains a queue, and decaying them to zero while it has none would make the first burst
        after a quiet spell look like minutes of queue to admission control."""
        if dt <= 0:
            return
        if not busy and not any(c.completed for c in self.counters.values()):
            return
        weight = 1.0 - math.exp(-dt / self.rate_tau_s)
        for c in self.counters.values():
            if c.measured:
                c.rate += weight * (c.completed / dt - c.rate)
            elif c.completed:  # the first measurement stands for itself (nothing to average it with)
                c.rate, c.measured = c.completed / dt, True
            c.completed = 0

    def step_seconds(self, rows: int) -> float:
        return self.decode.predict(max(1, rows))

    def doom_step_seconds(self, rows: int) -> float:
        """The token interval a running row is judged unable to finish at: the better of the moment's and the
        averaged one admission forecast it with. A spell of slow steps (the machine's, a burst's) does not
        condemn what admission just took (a request admitted with an eta 20% inside its deadline was evicted after
        2 tokens on an idle stack just after a burst); a lasting slowdown moves both."""
        return min(self.step_seconds(rows), self.forecast_step_seconds(rows))

    def forecast_row_seconds(self, rows: int) -> float:
        """What one more running row adds to the step admission forecasts (`forecast_step_seconds`): until the
        averaged fit has seen steps of more than one size, what the warm-up measured (`seed`; its slope is then the
        proportional stand-in, which reads a GPU's flat step as all per row)."""
        if not self.decode_slow.spread:
            return self.decode_slow.prior_slope
        return max(0.0, self.forecast_step_seconds(rows + 1) - self.forecast_step_seconds(rows))

    def forecast_step_seconds(self, rows: int) -> float:
        """The token interval admission forecasts a new request's tokens at (`decode_slow`)."""
        return self.decode_slow.predict(max(1, rows))

    def rows_within(self, per_token_s: float, limit: int) -> int:
        """The most running rows whose predicted token interval stays within `per_token_s` (at most `limit`;
        `limit` until the fit has seen enough steps to say)."""
        fit = self.decode
        if fit.n < WARM_SAMPLES:
            return limit
        slope, intercept = fit.slope, fit.intercept
        if slope <= 0:
            return limit if intercept <= per_token_s else 0
        return max(0, min(limit, int((per_token_s - intercept) / slope)))

    def service_model(self, rows: int) -> ServiceModel:
        """Whole requests' compute, as the scheduler's expiry and slack judge it: tokens at the averaged interval
        (`forecast_step_seconds`), as admission forecast them. Expiring waiting work is final, and at the
        moment's interval a spell of slow steps condemns every waiting request near its line at once (one mixed
        overload run, with the machine's token interval doubled for a few tens of seconds by other load, expired 7.6%
        of the admitted requests while those that did run finished at 1.1-1.3x their estimate)."""
        return ServiceModel(fixed_s=self.prefill.intercept, per_token_s=self.prefill.slope,
                            decode_s_per_token=self.forecast_step_seconds(rows))

    def total_rate(self) -> float:
        return sum(c.rate for c in self.counters.values())


def lane_wait_ms(*, window_s: float, waiting: int, free_rows: int, drain_rps: float, max_rows: int,
                 mean_service_s: float) -> float:
    """Expected queueing delay of a new request in a lane: its window, plus, when the rows are taken,
    the time for the queue ahead of it to drain (at the measured rate, else what the rows can do)."""
    wait = window_s
    short_of_rows = waiting + 1 - free_rows
    if short_of_rows > 0:
        rate = drain_rps if drain_rps > 0 else max_rows / max(mean_service_s, 1e-3)
        wait += short_of_rows / rate
    return wait * 1000
