import pytest

from gpu_worker.service_model import CostPrior, RunningFit, ServiceTracker, lane_wait_ms


def test_fit_recovers_a_line():
    fit = RunningFit(alpha=0.05)
    for x in range(1, 200):
        fit.add(x % 50 + 1, 0.002 + 0.0005 * (x % 50 + 1))
    assert fit.slope == pytest.approx(0.0005, rel=1e-3)
    assert fit.intercept == pytest.approx(0.002, rel=1e-2)
    assert fit.predict(10) == pytest.approx(0.007, rel=1e-2)


def test_fit_with_one_x_value_is_proportional_and_empty_fit_predicts_zero():
    assert RunningFit().predict(100) == 0.0
    fit = RunningFit()
    for _ in range(5):
        fit.add(10, 0.5)
    assert fit.predict(20) == pytest.approx(1.0)


def test_a_narrow_noisy_range_never_predicts_more_than_proportional_growth():
    fit = RunningFit(alpha=0.05)
    for i in range(400):  # a full batch: 16 rows nearly always, once in a while 15 and a quick step
        rows = 15 if i % 40 == 0 else 16
        y = 0.010 if rows == 15 else (0.300 if i % 5 == 0 else 0.030)  # every 5th: a prefill iteration
        fit.add(rows, y)
    mean = fit.predict(16)
    assert mean < 0.1  # about the mean interval (0.08 s); the unclamped fit said over 1 s per token
    assert fit.predict(32) <= 2 * mean + 1e-9 and fit.predict(1) <= mean
    assert fit.intercept >= 0


def test_fit_follows_a_change():
    fit = RunningFit(alpha=0.2)
    for x in range(100):
        fit.add(1 + x % 8, 0.01 * (1 + x % 8))
    for x in range(100):
        fit.add(1 + x % 8, 0.03 * (1 + x % 8))
    assert fit.slope == pytest.approx(0.03, rel=0.05)


def test_tracker_rates_and_service_model():
    t = ServiceTracker(("short", "long"))
    for _ in range(10):
        t.observe_completion("short")
    t.tick(1.0)
    assert t.counters["short"].rate == pytest.approx(10.0) and t.counters["long"].rate == 0
    for _ in range(60):  # a minute busy without a completion: the rate decays, over RATE_TAU_S
        t.tick(1.0)
    assert t.counters["short"].rate < 0.1
    for rows in (1, 2, 4, 8):
        t.observe_step(rows, 0.01 + 0.001 * rows)
    assert t.service_model(rows=4).decode_s_per_token == pytest.approx(0.014, rel=0.05)


@pytest.mark.parametrize(("kw", "ms"), [
    (dict(waiting=0, free_rows=4), 5.0),  # a row is free: just the window
    (dict(waiting=0, free_rows=0, drain_rps=10.0), 105.0),  # full, nobody waiting: the next completion
    (dict(waiting=5, free_rows=2, drain_rps=10.0), 405.0),  # 4 rows must free up
    (dict(waiting=3, free_rows=0, drain_rps=0.0), 5.0 + 4 / (8 / 2.0) * 1000),  # no rate yet: rows/service
])
def test_lane_wait(kw, ms):
    base = dict(window_s=0.005, drain_rps=0.0, max_rows=8, mean_service_s=2.0)
    assert lane_wait_ms(**{**base, **kw}) == pytest.approx(ms)


def test_an_idle_worker_keeps_its_drain_rate():
    t = ServiceTracker(("short",))
    for _ in range(20):
        for _ in range(5):
            t.observe_completion("short")
        t.tick(1.0)
    busy_rate = t.counters["short"].rate
    assert busy_rate == pytest.approx(5.0, rel=0.01)
    for _ in range(60):  # a quiet minute: nothing running, nothing waiting
        t.tick(1.0, busy=False)
    assert t.counters["short"].rate == busy_rate
    for _ in range(60):  # busy but finishing nothing for a minute: the rate does fall
        t.tick(1.0, busy=True)
    assert t.counters["short"].rate < 0.05


def test_a_starved_interval_does_not_make_every_token_look_slow():
    """A compute thread starved for a moment measures one interval far beyond the usual; the fit must not
    then predict seconds per token (it would expire or evict work that finishes in time)."""
    fit = RunningFit(alpha=0.05)
    for _ in range(50):
        fit.add(10, 0.05)
    for _ in range(3):
        fit.add(10, 5.0)  # three iterations starved for 5 s each
    assert fit.predict(10) < 0.1
    for _ in range(100):  # a lasting slowdown is still learned
        fit.add(10, 0.5)
    assert fit.predict(10) > 0.4


def test_a_lane_finishing_in_clumps_keeps_a_sensible_rate():
    """Long generations that finish two at a time every 4 s drain 0.5 per second; between clumps the rate
    must not read as nearly zero (admission would see minutes of queue)."""
    t = ServiceTracker(("long",))
    rates = []
    for second in range(120):
        if second % 4 == 0:
            t.observe_completion("long")
            t.observe_completion("long")
        t.tick(1.0)
        if second >= 60:
            rates.append(t.counters["long"].rate)
    assert min(rates) > 0.3 and max(rates) < 0.8


def test_rows_within_a_token_budget():
    t = ServiceTracker(("short",))
    assert t.rows_within(0.001, 64) == 64  # nothing measured yet: no limit
    for rows in (1, 2, 4, 8, 16, 32) * 2:
        t.observe_step(rows, 0.01 + 0.002 * rows)
    assert t.rows_within(0.05, 64) == 20  # 0.01 + 0.002 x 20 = 0.05
    assert t.rows_within(0.2, 64) == 64
    assert t.rows_within(0.005, 64) == 0  # even one row is slower than that


def test_admission_forecasts_tokens_at_an_interval_a_second_of_slow_steps_barely_moves():
    """A generation spans many seconds: the interval admission forecasts with (`forecast_step_seconds`) follows a
    lasting change but not a burst of ten slow steps, which moves the scheduler's own fit by tens of percent."""
    t = ServiceTracker(("short",))
    for _ in range(500):
        t.observe_step(64, 0.100)
    for _ in range(10):  # a second of steps at 1.5x (prefills, the machine's hiccups)
        t.observe_step(64, 0.150)
    assert t.step_seconds(64) > 0.118
    assert t.forecast_step_seconds(64) < 0.105
    for _ in range(400):  # a lasting change is learned
        t.observe_step(64, 0.150)
    assert t.forecast_step_seconds(64) == pytest.approx(0.150, rel=0.03)


def test_a_seeded_fit_predicts_its_prior_until_its_first_sample_replaces_it():
    f = RunningFit()
    assert f.predict(10) == 0.0  # an empty fit promises anything
    f.seed(0.02, 0.001)
    assert f.n == 0 and f.predict(10) == pytest.approx(0.03) and f.intercept == 0.02 and f.slope == 0.001
    f.add(4, 0.5)  # the first measurement stands for itself, the prior gone
    assert f.predict(4) == pytest.approx(0.5) and f.predict(8) == pytest.approx(1.0)
    g = RunningFit()
    g.seed(-1.0, -2.0)  # a cost is never below zero
    assert g.intercept == 0.0 and g.slope == 0.0


def test_a_tracker_seeded_with_a_runners_costs_estimates_requests_before_measuring_any():
    t = ServiceTracker(("short",))
    t.seed(CostPrior(prefill_fixed_s=0.01, prefill_per_token_s=0.001, step_s=0.03, step_per_row_s=0.002))
    assert t.step_seconds(1) == pytest.approx(0.032) and t.forecast_step_seconds(4) == pytest.approx(0.038)
    model = t.service_model(1)
    assert (model.fixed_s, model.per_token_s, model.decode_s_per_token) == pytest.approx((0.01, 0.001, 0.032))
    t.observe_round(1, 0.05, 0.05, 0, 0.0, fused=False, chunking=False)
    assert t.step_seconds(1) == pytest.approx(0.05)  # measured: the prior no longer counts
    assert t.prefill.predict(100) == pytest.approx(0.11)  # prefill not measured yet: still the prior


@pytest.mark.parametrize(("short", "long", "fixed", "per_token"), [
    ((4, 0.010), (64, 0.070), 0.006, 0.001),  # a line through the two
    ((64, 0.070), (4, 0.010), 0.006, 0.001),  # in either order
    ((4, 0.020), (64, 0.015), 0.020, 0.0),  # the longer ran faster (noise): flat at the slower
    ((4, 0.001), (64, 0.121), 0.0, 0.002),  # a line below zero at no tokens: no fixed part
    ((4, 0.010), (4, 0.012), 0.012, 0.0),  # one size only
])
def test_a_prior_through_two_timed_prefills(short, long, fixed, per_token):
    prior = CostPrior.through(short, long, step_s=0.005)
    assert (prior.prefill_fixed_s, prior.prefill_per_token_s, prior.step_s) == pytest.approx((fixed, per_token, 0.005))


def test_what_a_row_adds_to_a_step_is_published_only_once_measured():
    """Admission adds what each joining row costs a step (`forecast_row_seconds`); while every step seen had one size,
    the fit's slope is the proportional stand-in (a GPU's flat 7 ms step at 10 rows would read as 0.7 ms a row), so
    nothing is added until steps of several sizes were seen."""
    t = ServiceTracker(("short",))
    for _ in range(10):
        t.observe_step(10, 0.007)
    assert t.forecast_row_seconds(10) == 0.0
    t = ServiceTracker(("short",))
    for _ in range(40):
        for rows in (1, 4, 8):
            t.observe_step(rows, 0.010 + 0.002 * rows)  # a CPU's: 2 ms a row
    assert t.forecast_row_seconds(4) == pytest.approx(0.002, rel=0.2)
