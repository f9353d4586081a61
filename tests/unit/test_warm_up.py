"""The warm-up's timings: what stands in for the measured costs until requests have run (`gpu_worker.warm_up`)."""

from __future__ import annotations

import pytest

from gpu_worker.sequences import GenSpec
from gpu_worker.service_model import ServiceTracker
from gpu_worker.warm_up import WARM_BATCHES, WARM_NEW_TOKENS, WARM_ROWS, timed_generations


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CostedEngine:
    """An engine whose prefill takes 5 ms + 1 ms a prompt token and whose decode step takes `step` + `per_row` a row,
    on a clock of its own."""

    def __init__(self, clock: Clock, *, max_rows: int, step: float = 0.010, per_row: float = 0.002) -> None:
        self.clock, self.max_rows, self.step_s, self.per_row = clock, max_rows, step, per_row
        self.rows: dict[str, int] = {}  # id -> tokens still to make
        self.most_rows = 0
        self.stats = None

    @property
    def running(self) -> int:
        return len(self.rows)

    def prefill(self, specs: list[GenSpec]) -> list[object]:
        assert len(specs) + len(self.rows) <= self.max_rows
        self.clock.now += 0.005 + 0.001 * sum(len(s.prompt_ids) for s in specs)
        for s in specs:
            self.rows[s.id] = s.max_new_tokens - 1  # the prefill makes the first token
        self.most_rows = max(self.most_rows, len(self.rows))
        return []

    def step(self) -> list[object]:
        self.clock.now += self.step_s + self.per_row * len(self.rows)
        self.rows = {k: n - 1 for k, n in self.rows.items() if n > 1}
        return []


@pytest.mark.parametrize(("max_rows", "per_row"), [(64, 0.002), (4, 0.002), (64, 0.0), (1, 0.002)])
def test_the_warm_up_times_what_a_row_adds_to_a_decode_step(max_rows: int, per_row: float) -> None:
    """Beside the prefill line and the one-row step, a batch of `WARM_ROWS` (fewer if the engine has fewer rows)
    is timed: the decode step's fixed part and cost per row are a line through the two, so admission prices the
    rows a burst adds from the first request (a fresh worker priced them at 0 until it had run steps of several
    sizes, and admitted a whole burst at the one-row step). One row: no batch to time, nothing per row."""
    clock = Clock()
    engine = CostedEngine(clock, max_rows=max_rows, per_row=per_row)
    prior = timed_generations(engine, vocab=100, longest=1000, clock=clock)
    assert engine.running == 0 and engine.most_rows == min(WARM_ROWS, max_rows)
    assert WARM_NEW_TOKENS > 1  # steps were timed
    want_per_row = per_row if max_rows > 1 else 0.0
    assert prior.step_per_row_s == pytest.approx(want_per_row, abs=1e-9)
    assert prior.step_s + prior.step_per_row_s == pytest.approx(0.010 + per_row)  # the one-row step
    assert (prior.prefill_fixed_s, prior.prefill_per_token_s) == pytest.approx((0.005, 0.001))


def test_a_step_that_ran_faster_with_more_rows_gives_no_cost_per_row() -> None:
    """Noise (a slow one-row step) never makes a row cost less than nothing."""
    clock = Clock()
    engine = CostedEngine(clock, max_rows=16, per_row=-0.0005)
    prior = timed_generations(engine, vocab=100, longest=1000, clock=clock)
    assert prior.step_per_row_s == 0.0 and prior.step_s == pytest.approx(0.0095)


class BusyEngine(CostedEngine):
    """A `CostedEngine` on a machine busy with something else while its first batch of several rows runs: each of
    that batch's steps takes `extra` more."""

    def __init__(self, clock: Clock, *, max_rows: int, extra: float) -> None:
        super().__init__(clock, max_rows=max_rows)
        self.extra, self.batches = extra, 0

    def prefill(self, specs: list[GenSpec]) -> list[object]:
        self.batches += len(specs) > 1
        return super().prefill(specs)

    def step(self) -> list[object]:
        self.clock.now += self.extra if self.batches == 1 and len(self.rows) > 1 else 0.0
        return super().step()


def test_a_busy_machine_during_one_timed_batch_leaves_the_steps_fixed_part() -> None:
    """The batch is timed `WARM_BATCHES` times, its fastest step kept: one batch slowed by other work (CI's other
    tests) read as a step that is all cost per row (fixed part 0, one row 5 ms where it takes 12 ms)."""
    clock = Clock()
    engine = BusyEngine(clock, max_rows=16, extra=0.100)
    prior = timed_generations(engine, vocab=100, longest=1000, clock=clock)
    assert WARM_BATCHES > 1 and engine.batches == WARM_BATCHES and engine.running == 0
    assert (prior.step_s, prior.step_per_row_s) == pytest.approx((0.010, 0.002))


def test_the_warm_ups_cost_per_row_is_published_until_steps_of_several_sizes_are_measured() -> None:
    """A fresh worker publishes the warm-up's cost per row (admission adds it for each joining row); steps of one
    size (a proportional stand-in, no slope) leave it; steps of several sizes replace it with what they measure."""
    clock = Clock()
    prior = timed_generations(CostedEngine(clock, max_rows=16, per_row=0.003), vocab=100, longest=1000, clock=clock)
    t = ServiceTracker(("short",))
    t.seed(prior)
    assert t.forecast_row_seconds(1) == pytest.approx(0.003)
    assert t.forecast_step_seconds(8) == pytest.approx(0.010 + 8 * 0.003)
    for _ in range(10):
        t.observe_step(8, 0.040)
    assert t.forecast_row_seconds(8) == pytest.approx(0.003)
    for _ in range(300):  # the averaged fit forgets slowly (`ADMISSION_ALPHA`)
        for rows in (1, 4, 8):
            t.observe_step(rows, 0.010 + 0.001 * rows)
    assert t.forecast_row_seconds(4) == pytest.approx(0.001, rel=0.1)
