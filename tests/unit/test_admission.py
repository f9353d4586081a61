"""The admission estimate, as a table of cases with plain numbers (no Redis, no clock)."""

import pytest

from shared.admission import MIN_DRAIN_SHARE, Estimate, RecentAdmits, decide, estimate, fresh, near_line
from shared.messages import LaneStat, LaneStats


def stats(*, free=4, max_rows=8, rps=0.0, running=0, at_ms=10_000, fixed=10.0, per_tok=0.1, step=20.0,
          lane="short", waiting=0, per_row=0.0):
    return LaneStats(model="m", worker="w", at_ms=at_ms, max_rows=max_rows, free_rows=free, deadline_aware=True,
                     prefill_fixed_ms=fixed, prefill_ms_per_token=per_tok, decode_ms_per_step=step,
                     lanes=(LaneStat(lane, waiting, running, rps, 0.0),), decode_ms_per_row=per_row)


def test_only_fresh_stats_count():
    assert fresh([stats(at_ms=1_000), stats(at_ms=9_000)], now_ms=10_000, max_age_ms=5_000) == [stats(at_ms=9_000)]


def test_no_stats_means_no_estimate():
    assert estimate([], "short", 3, 10, 10, 0.005) == Estimate(0.0, 0.0, "none")


@pytest.mark.parametrize(("kw", "queued", "prompt", "new", "start", "finish"), [
    # a free row: start after the window; compute = 10 ms + 100 x 0.1 ms + 32 x 20 ms = 660 ms
    ({}, 0, 100, 32, 0.005, 0.665),
    # 6 waiting ahead, drained at the measured 10/s (more than the free rows)
    ({"rps": 10.0}, 6, 100, 32, 0.605, 1.265),
    # ... or fewer, but the worker holds requests back: throughput, not rows, frees room for them
    ({"rps": 10.0, "free": 8, "waiting": 2}, 6, 100, 32, 0.605, 1.265),
    # a burst after light traffic (1.5/s measured): 12 ahead, 60 free rows, nothing held back: they start now
    ({"rps": 1.5, "free": 60, "max_rows": 64}, 12, 100, 32, 0.005, 0.665),
    # same, no completions measured yet (a fresh worker): the rows started together end together, so the 3 beyond
    # the free rows wait a whole turn of the 8 rows at its own compute (not 3/8 of one: a burst's fifth request at 4
    # idle rows was promised a quarter of a turn and expired)
    ({}, 6, 100, 32, 0.005 + 0.66, 0.005 + 0.66 + 0.66),
    # the queued entries are running ones, not waiting ones: nobody ahead
    ({"running": 6, "rps": 10.0}, 6, 100, 32, 0.005, 0.665),
    # nothing measured yet and a free row for it: just the window
    ({"free": 8}, 6, 100, 32, 0.005, 0.665),
])
def test_estimate(kw, queued, prompt, new, start, finish):
    est = estimate([stats(**kw)], "short", queued, prompt, new, 0.005)
    assert est.basis == "stats"
    assert est.start_s == pytest.approx(start) and est.finish_s == pytest.approx(finish)


def test_a_free_row_beyond_the_lanes_share_starts_nothing_of_it():
    """An idle engine of 2 rows holds the long lane to 0.75 of them (1 row): a second long request has no row to
    start on though a row is free, and waits for the first's service (both were admitted with the window's wait,
    and the second expired unstarted: a probe's finding). 64 rows at 0.75: 48 for the lane."""
    idle = stats(free=2, max_rows=2, lane="long")
    service = 0.01 + 100 * 0.0001 + 32 * 0.02
    assert estimate([idle], "long", 0, 100, 32, 0.005, 0.75).start_s == pytest.approx(0.005)
    second = estimate([idle], "long", 1, 100, 32, 0.005, 0.75)
    assert second.start_s == pytest.approx(0.005 + service)  # one row's drain: the one ahead's whole service
    assert estimate([idle], "long", 1, 100, 32, 0.005).start_s == pytest.approx(0.005)  # no share: a row each
    busy = stats(free=30, max_rows=64, running=40, lane="long")  # 8 of its 48 rows left
    assert estimate([busy], "long", 40 + 8, 100, 32, 0.005, 0.75).start_s > 0.005
    assert estimate([busy], "long", 40 + 7, 100, 32, 0.005, 0.75).start_s == pytest.approx(0.005)


def test_a_requests_tokens_are_forecast_at_the_step_of_the_rows_running_once_it_and_those_ahead_start():
    """Where every row slows every step (2 ms a row here, a CPU's), a burst at an idle worker is not forecast at the
    one-row step: each request's tokens at the step of the rows running once it and those ahead of it started, as far
    as there are free rows (10 sampled requests of 128 tokens, each 1 s alone, were all admitted for 2 s deadlines
    and could not all finish)."""
    idle = stats(free=8, max_rows=8, per_row=2.0)
    compute = [estimate([idle], "short", queued, 100, 32, 0.005).finish_s for queued in range(10)]
    base = 0.005 + 0.01 + 100 * 0.0001
    assert compute[0] == pytest.approx(base + 32 * 0.020)  # alone: the one-row step
    assert compute[3] == pytest.approx(base + 32 * (0.020 + 3 * 0.002))  # the 4th of a burst: 4 rows running
    beyond = estimate([idle], "short", 9, 100, 32, 0.005)  # past the 8 free rows: it waits instead of adding rows
    assert beyond.start_s > 0.005 and beyond.finish_s - beyond.start_s == pytest.approx(
        base - 0.005 + 32 * (0.020 + 7 * 0.002))
    busy = stats(free=4, max_rows=8, running=4, per_row=2.0)  # the step published at its 4 running rows
    assert estimate([busy], "short", 4, 100, 32, 0.005).finish_s == pytest.approx(base + 32 * (0.020 + 0.002))
    assert estimate([busy], "short", 6, 100, 32, 0.005).finish_s == pytest.approx(base + 32 * (0.020 + 3 * 0.002))
    # where rows cost nothing (a GPU's flat step; an older worker publishing none) nothing changes
    assert estimate([stats(free=8, max_rows=8)], "short", 3, 100, 32, 0.005).finish_s == pytest.approx(0.665)


def test_workers_add_up():
    one = estimate([stats(free=0, rps=5.0)], "short", 10, 10, 1, 0.0)
    two = estimate([stats(free=0, rps=5.0), stats(free=0, rps=5.0)], "short", 10, 10, 1, 0.0)
    assert two.start_s == pytest.approx(one.start_s / 2)


@pytest.mark.parametrize(("deadline", "queued", "accept", "code"), [
    (100.0 + 0.8, 0, True, ""),  # 0.665 s estimated, with the 15% margin 0.76 s: fits
    (100.0 + 0.7, 0, False, "deadline_infeasible"),  # fits the bare estimate, not the margin
    (100.0 + 0.5, 0, False, "deadline_infeasible"),
    (100.0 + 60, 50, False, "backlog_full"),
])
def test_decide(deadline, queued, accept, code):
    est = Estimate(0.005, 0.665, "stats")
    d = decide(now_s=100.0, deadline_s=deadline, est=est, queued=queued, max_backlog=50)
    assert d.accept is accept and d.code == code
    if not accept:
        assert d.retry_after_s >= 1 and d.reason


def test_infeasible_message_says_why():
    d = decide(now_s=0, deadline_s=1.0, est=Estimate(2.0, 2.5, "stats"), queued=3, max_backlog=100)
    assert "estimated finish in 2500 ms" in d.reason and d.retry_after_s == 2
    d = decide(now_s=0, deadline_s=0.1, est=Estimate(0.0, 0.5, "stats"), queued=0, max_backlog=100)
    assert "needs about 500 ms of compute" in d.reason


def test_a_refusal_says_whether_a_retry_could_change_it():
    queue_too_long = decide(now_s=0, deadline_s=1.0, est=Estimate(2.0, 2.5, "stats"), queued=3, max_backlog=100)
    assert not queue_too_long.accept and queue_too_long.retryable  # the queue drains: later it may fit
    compute_too_long = decide(now_s=0, deadline_s=0.1, est=Estimate(0.0, 0.5, "stats"), queued=0, max_backlog=100)
    assert not compute_too_long.accept and not compute_too_long.retryable  # its own compute never fits
    full = decide(now_s=0, deadline_s=60.0, est=Estimate(0.0, 0.5, "stats"), queued=100, max_backlog=100)
    assert full.code == "backlog_full" and full.retryable


def test_without_stats_accept_up_to_the_cap():
    none = Estimate(0.0, 0.0, "none")
    assert decide(now_s=0, deadline_s=0.001, est=none, queued=1, max_backlog=5).accept
    assert not decide(now_s=0, deadline_s=100, est=none, queued=5, max_backlog=5).accept


def test_fifo_baseline_is_not_refused_for_deadlines():
    d = decide(now_s=0, deadline_s=0.1, est=Estimate(2.0, 2.5, "stats"), queued=3, max_backlog=100,
               deadline_aware=False)
    assert d.accept


def test_a_lane_is_estimated_from_the_engine_that_serves_it():
    """A worker with a short-lane engine and a long-lane engine publishes one entry each: a short request's
    estimate uses the short engine's step time and completions, not the long engine's."""
    short = stats(step=15.0, rps=10.0, running=2, lane="short")
    long = stats(step=60.0, rps=1.0, running=12, lane="long", fixed=40.0)
    est = estimate([long, short], "short", queued=2, prompt_tokens=10, new_tokens=10, window_s=0.0)
    assert est.finish_s == pytest.approx((10.0 + 0.1 * 10 + 15.0 * 10) / 1000)
    est_long = estimate([long, short], "long", queued=12, prompt_tokens=10, new_tokens=10, window_s=0.0)
    assert est_long.finish_s == pytest.approx((40.0 + 0.1 * 10 + 60.0 * 10) / 1000)


def test_stats_that_list_no_lane_still_count():
    """Older workers' entries, or a lane no engine has reported yet: every fresh entry counts."""
    est = estimate([stats(step=20.0, lane="long")], "short", queued=0, prompt_tokens=10, new_tokens=10, window_s=0.0)
    assert est.basis == "stats" and est.finish_s == pytest.approx((10.0 + 1.0 + 200.0) / 1000)


def test_an_engine_that_has_measured_nothing_borrows_the_others_costs():
    """A long-lane engine that has run nothing yet publishes zero costs: they must not promise any deadline."""
    short = stats(step=15.0, lane="short")
    idle_long = stats(step=0.0, fixed=0.0, per_tok=0.0, lane="long")
    est = estimate([short, idle_long], "long", queued=0, prompt_tokens=100, new_tokens=100, window_s=0.0)
    assert est.finish_s == pytest.approx((10.0 + 0.1 * 100 + 15.0 * 100) / 1000)


def test_a_lane_drains_at_the_rows_its_shorter_lanes_leave_it():
    """The scheduler starts an engine's shorter lanes first: while a medium request waits, the short lane's arrivals
    keep taking their share of the rows (under overload, most of a medium request's wait). The short requests
    waiting now are that share's standing queue, not extra work ahead: counting them too made the medium lane's
    estimate pessimistic under the mixed overload (actual / estimated queue 0.75-0.8)."""
    engine = LaneStats(model="m", worker="w", at_ms=10_000, max_rows=8, free_rows=0, deadline_aware=True,
                       prefill_fixed_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_step=20.0,
                       lanes=(LaneStat("short", 20, 4, 6.0, 0.0), LaneStat("medium", 5, 4, 4.0, 0.0)))
    est = estimate([engine], "medium", queued=9, prompt_tokens=10, new_tokens=10, window_s=0.0)
    # 9 in the medium stream, 4 of them running: 5 waiting; of the 10 completions a second the short lane's 6 are
    # rows its new arrivals keep taking first, so the medium lane drains at 4
    assert est.start_s == pytest.approx(5 / 4.0)
    est_short = estimate([engine], "short", queued=24, prompt_tokens=10, new_tokens=10, window_s=0.0)
    assert est_short.start_s == pytest.approx(20 / 10.0)  # nothing shorter ahead of the short lane: all the rows


def test_a_lane_behind_busy_shorter_lanes_still_drains_at_a_share_of_the_rows():
    """Shorter lanes completing nearly everything leave a longer lane a floor of the rows' rate, never none."""
    engine = LaneStats(model="m", worker="w", at_ms=10_000, max_rows=8, free_rows=0, deadline_aware=True,
                       prefill_fixed_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_step=20.0,
                       lanes=(LaneStat("short", 0, 8, 10.0, 0.0), LaneStat("medium", 3, 0, 0.0, 0.0)))
    est = estimate([engine], "medium", queued=3, prompt_tokens=10, new_tokens=10, window_s=0.0)
    assert est.start_s == pytest.approx(3 / (MIN_DRAIN_SHARE * 10.0))


# --- consistency: no refusal for the margin alone right after a larger admission ----------------------------------
# deadline 10 s away; estimated finish 8.9 s: within the inner 5% margin (9.35), not the 15% one (8.9 x 1.15 = 10.2)
NEAR = Estimate(start_s=6.9, finish_s=8.9, basis="stats")  # 2 s of compute


@pytest.mark.parametrize("larger_admitted", [False, True])
def test_a_request_no_larger_than_one_admitted_lately_is_not_refused_for_the_margin_alone(larger_admitted):
    d = decide(now_s=0.0, deadline_s=10.0, est=NEAR, queued=3, max_backlog=100, larger_admitted=larger_admitted)
    assert d.accept is larger_admitted and d.within_margin is larger_admitted
    if not larger_admitted:
        assert d.code == "deadline_infeasible"


def test_the_consistency_rule_never_admits_past_the_inner_margin():
    late = Estimate(start_s=8.5, finish_s=10.5, basis="stats")
    d = decide(now_s=0.0, deadline_s=10.0, est=late, queued=3, max_backlog=100, larger_admitted=True)
    assert not d.accept and d.code == "deadline_infeasible"
    near = Estimate(start_s=7.0, finish_s=9.6, basis="stats")  # meets the deadline, not with 5% (10.08)
    d = decide(now_s=0.0, deadline_s=10.0, est=near, queued=3, max_backlog=100, larger_admitted=True)
    assert not d.accept and d.code == "deadline_infeasible"
    within = decide(now_s=0.0, deadline_s=10.0, est=Estimate(1.0, 3.0, "stats"), queued=3, max_backlog=100,
                    larger_admitted=True)
    assert within.accept and not within.within_margin  # inside the margin anyway: an ordinary admission


def test_recent_admits_cover_what_is_no_larger_within_the_window_only():
    recent = RecentAdmits(window_s=3.0)
    assert not recent.covers(0.0, 1, 1)
    recent.note(0.0, 200, 100)
    recent.note(1.0, 50, 120)
    assert recent.covers(2.9, 200, 100) and recent.covers(2.9, 150, 90) and recent.covers(2.9, 40, 110)
    assert not recent.covers(2.9, 201, 100) and not recent.covers(2.9, 60, 110)  # larger in one of the two
    assert not recent.covers(3.5, 150, 90) and recent.covers(3.5, 50, 120)  # the first left the window
    assert not recent.covers(4.1, 1, 1)


def test_recent_decisions_compare_time_budgets_too():
    recent = RecentAdmits(window_s=3.0)
    recent.note(0.0, 100, 50, budget_s=30.0)
    assert recent.covers(1.0, 100, 50, budget_s=30.0) and recent.covers(1.0, 90, 40, budget_s=45.0)
    assert not recent.covers(1.0, 90, 40, budget_s=20.0)  # the admitted one had more time: it says nothing here
    assert recent.below(1.0, 100, 50, budget_s=30.0) and recent.below(1.0, 110, 60, budget_s=20.0)
    assert not recent.below(1.0, 110, 60, budget_s=40.0)  # more time than the noted one
    assert not recent.below(1.0, 90, 60, budget_s=20.0)  # smaller in one of the two
    # one timeout, submitted a moment apart: budgets milliseconds apart are the same budget
    assert recent.covers(1.0, 100, 50, budget_s=29.998) and recent.below(1.0, 100, 50, budget_s=30.002)
    assert not recent.below(3.5, 110, 60, budget_s=20.0)  # it left the window
    short = RecentAdmits(window_s=3.0)
    short.note(0.0, 10, 10, budget_s=3.0)  # a refusal with a 3 s budget holds for 5% of it, 0.15 s
    assert short.below(0.1, 10, 10, budget_s=3.0) and not short.below(0.2, 10, 10, budget_s=3.0)


# --- consistency: no admission near the line right after a smaller refusal -------------------------------------------
# deadline 10 s away; estimated finish 8.2 s: within the 15% margin (9.43), not within the band (8.2 x 1.3 = 10.66)
NEAR_INSIDE = Estimate(start_s=6.2, finish_s=8.2, basis="stats")


@pytest.mark.parametrize("smaller_refused", [False, True])
def test_a_request_no_smaller_than_one_refused_lately_is_refused_near_the_line(smaller_refused):
    d = decide(now_s=0.0, deadline_s=10.0, est=NEAR_INSIDE, queued=3, max_backlog=100,
               smaller_refused=smaller_refused)
    assert d.accept is not smaller_refused
    if smaller_refused:
        assert d.code == "deadline_infeasible" and d.retryable and d.retry_after_s == 7
        assert "refused within the last 3 s" in d.reason


def test_far_from_the_line_a_refusal_nearby_changes_nothing():
    clear = Estimate(start_s=4.0, finish_s=7.0, basis="stats")  # 7 x 1.3 = 9.1 s: clears the band
    assert decide(now_s=0.0, deadline_s=10.0, est=clear, queued=3, max_backlog=100, smaller_refused=True).accept


def test_a_smaller_refusal_outweighs_a_larger_admission_inside_the_margin():
    """Both happened within the window (the line moved between them): the request is judged on its own estimate,
    with the margin, rather than admitted inside it."""
    d = decide(now_s=0.0, deadline_s=10.0, est=NEAR, queued=3, max_backlog=100, larger_admitted=True,
               smaller_refused=True)
    assert not d.accept and d.code == "deadline_infeasible"


@pytest.mark.parametrize("finish", [0.5, 5.0, 7.0, 7.6, 7.7, 8.2, 8.9, 9.6, 10.0, 10.5, 20.0])
@pytest.mark.parametrize("basis", ["stats", "none"])
def test_away_from_the_line_what_was_decided_lately_cannot_change_a_decision(finish, basis):
    """`near_line` is where the caller must look up the lane's recent decisions; elsewhere `decide` answers the
    same whatever they were (the look-up, a scan of seconds of decisions, is skipped there)."""
    est = Estimate(start_s=finish / 2, finish_s=finish, basis=basis)
    answers = {(d.accept, d.code, d.within_margin)
               for larger in (False, True) for smaller in (False, True)
               for d in [decide(now_s=0.0, deadline_s=10.0, est=est, queued=3, max_backlog=100,
                                larger_admitted=larger, smaller_refused=smaller)]}
    if not near_line(now_s=0.0, deadline_s=10.0, est=est):
        assert len(answers) == 1
    elif basis == "stats" and finish in (8.2, 8.9):  # inside the band or the margin: the recent decisions count
        assert len(answers) == 2


def lanes_stats(*lanes: LaneStat, free=0, max_rows=4, rps=0.0, at_ms=10_000, preemptible=0, step=20.0):
    return LaneStats(model="m", worker="w", at_ms=at_ms, max_rows=max_rows, free_rows=free, deadline_aware=True,
                     prefill_fixed_ms=10.0, prefill_ms_per_token=0.1, decode_ms_per_step=step, lanes=lanes,
                     preemptible=preemptible)


SERVICE = 0.01 + 100 * 0.0001 + 32 * 0.02  # the compute of the requests below: 660 ms


def test_with_every_row_busy_and_nothing_waiting_a_request_starts_when_the_first_row_ends():
    """4 rows busy for another 3-5 s, nothing waiting: a request starts when the first ends, not at once (it was
    admitted with the window's wait and a 2.5 s deadline, then expired in the queue: an outside probe, 6 of 6). The
    row ends are aged by the time since the worker published them."""
    busy = lanes_stats(LaneStat("short", 0, 4, 0.8, 0.0, frees_ms=(3000, 4000, 4500, 5000)))
    est = estimate([busy], "short", 4, 100, 32, 0.005, key=(0, 60_000), now_ms=10_000)
    assert est.start_s == pytest.approx(0.005 + 3.0) and est.finish_s == pytest.approx(0.005 + 3.0 + SERVICE)
    later = estimate([busy], "short", 4, 100, 32, 0.005, key=(0, 60_000), now_ms=11_000)  # a second later
    assert later.start_s == pytest.approx(0.005 + 2.0)
    refused = decide(now_s=10.0, deadline_s=12.5, est=est, queued=4, max_backlog=100)
    assert not refused.accept and refused.code == "deadline_infeasible" and refused.retryable
    # requests ahead of it: the rows turn over at the measured rate (0.8/s), and not before the first one ends
    assert estimate([busy], "short", 6, 100, 32, 0.005, key=(0, 60_000), now_ms=10_000).start_s == pytest.approx(
        0.005 + max(2 / 0.8, 3.0))
    assert estimate([busy], "short", 10, 100, 32, 0.005, key=(0, 60_000), now_ms=10_000).start_s == pytest.approx(
        0.005 + 6 / 0.8)
    # a free row: no wait for one
    free = lanes_stats(LaneStat("short", 0, 3, 0.8, 0.0, frees_ms=(3000, 4000, 4500)), free=1)
    assert estimate([free], "short", 3, 100, 32, 0.005, key=(0, 60_000), now_ms=10_000).start_s == pytest.approx(
        0.005)


def test_a_request_is_behind_only_the_waiting_requests_the_worker_starts_before_it():
    """The worker starts waiting requests in (priority, deadline) order: a request due sooner than another tenant's
    flood, or interactive behind queued batch-priority work, has none of them ahead of it (they were all counted,
    and the request refused as infeasible though it was started first and finished in time: an outside probe)."""
    flood = tuple((0, 70_000 + i) for i in range(16))  # 16 interactive requests due at 70 s
    engine = lanes_stats(LaneStat("short", 16, 4, 0.8, 0.0, order=flood, frees_ms=(1000, 2000, 3000, 4000)))
    urgent = estimate([engine], "short", 20, 100, 32, 0.005, key=(0, 15_000), now_ms=10_000)
    assert urgent.start_s == pytest.approx(0.005 + 1.0)  # the first row to end is its own
    assert decide(now_s=10.0, deadline_s=15.0, est=urgent, queued=20, max_backlog=100).accept
    late = estimate([engine], "short", 20, 100, 32, 0.005, key=(0, 80_000), now_ms=10_000)
    assert late.start_s > 0.005 + 16 / 0.8 - 1e-9  # after the whole flood, at the measured rate
    equal = estimate([engine], "short", 20, 100, 32, 0.005, key=(0, 70_007), now_ms=10_000)  # ties: after them
    assert equal.start_s == pytest.approx(0.005 + 8 / 0.8)
    batch = tuple((1, 20_000 + i) for i in range(8))  # batch-priority work, due sooner, still after interactive
    engine = lanes_stats(LaneStat("short", 8, 4, 0.8, 0.0, order=batch, frees_ms=(1000, 2000, 3000, 4000)))
    assert estimate([engine], "short", 12, 100, 32, 0.005, key=(0, 60_000), now_ms=10_000).start_s == \
        pytest.approx(0.005 + 1.0)
    assert estimate([engine], "short", 12, 100, 32, 0.005, key=(1, 60_000), now_ms=10_000).start_s == \
        pytest.approx(0.005 + 8 / 0.8)
    # sampled: 64 keys standing for 640 waiting requests, 10 each
    many = lanes_stats(LaneStat("short", 640, 4, 100.0, 0.0, order=tuple((0, 20_000 + 100 * i) for i in range(64))))
    assert estimate([many], "short", 644, 100, 32, 0.005, key=(0, 20_000 + 100 * 31 + 50),
                    now_ms=10_000).start_s == pytest.approx(0.005 + 320 / 100.0)
    # the stream's entries no worker read yet are ahead whatever their keys; an older worker's (no order): all
    assert estimate([many], "short", 650, 100, 32, 0.005, key=(0, 0), now_ms=10_000).start_s == pytest.approx(
        0.005 + 6 / 100.0)
    old = lanes_stats(LaneStat("short", 16, 4, 0.8, 0.0))
    assert estimate([old], "short", 20, 100, 32, 0.005, key=(0, 15_000), now_ms=10_000).start_s == pytest.approx(
        0.005 + 16 / 0.8)


def test_an_interactive_request_takes_a_batch_priority_row_instead_of_waiting():
    """Every row runs batch-priority work for seconds: an interactive request that cannot wait takes one of their
    rows (the scheduler preempts), so it has no row end to wait for; a batch-priority one has."""
    engine = lanes_stats(LaneStat("short", 0, 4, 0.8, 0.0, frees_ms=(3000, 4000, 4500, 5000)), preemptible=4)
    assert estimate([engine], "short", 4, 100, 32, 0.005, key=(0, 12_500), now_ms=10_000).start_s == \
        pytest.approx(0.005)
    assert estimate([engine], "short", 4, 100, 32, 0.005, key=(1, 12_500), now_ms=10_000).start_s == \
        pytest.approx(0.005 + 3.0)


def test_a_lane_holding_its_whole_share_waits_for_its_own_rows():
    """The long lane holds its 3 rows of 4 (0.75): a long request starts when one of the long rows ends, not when
    the short row does; below its share, any row's end is one it may take."""
    engine = lanes_stats(LaneStat("short", 0, 1, 5.0, 0.0, frees_ms=(200,)),
                         LaneStat("long", 0, 3, 0.5, 0.0, frees_ms=(4000, 5000, 6000)))
    assert estimate([engine], "long", 3, 100, 32, 0.005, 0.75, key=(0, 60_000), now_ms=10_000).start_s == \
        pytest.approx(0.005 + 4.0)
    below = lanes_stats(LaneStat("short", 0, 2, 5.0, 0.0, frees_ms=(200, 300)),
                        LaneStat("long", 0, 2, 0.5, 0.0, frees_ms=(4000, 5000)))
    assert estimate([below], "long", 2, 100, 32, 0.005, 0.75, key=(0, 60_000), now_ms=10_000).start_s == \
        pytest.approx(0.005 + 0.2)


def test_batch_priority_rows_count_for_an_interactive_request_only_where_its_lane_may_take_a_row():
    """The long lane holds its 2 rows of 4 (0.5): the 2 batch-priority short rows are not its to take, so an
    interactive long request waits for a long row to end (it was admitted with no wait and expired: an outside
    probe, 3 of 3). And an interactive request behind another one, on rows all running batch work with more
    queued, has a row each to take: no drain at the batch work's completion rate (it was refused, and the later
    one behind it finished in 0.5 s)."""
    engine = lanes_stats(LaneStat("short", 0, 2, 0.5, 0.0, frees_ms=(3000, 3500)),
                         LaneStat("long", 0, 2, 0.2, 0.0, frees_ms=(8000, 9000)), preemptible=2)
    capped = estimate([engine], "long", 2, 100, 32, 0.005, 0.5, key=(0, 60_000), now_ms=10_000)
    assert capped.start_s == pytest.approx(0.005 + 8.0)
    batch_work = lanes_stats(LaneStat("short", 9, 4, 0.66, 0.0, order=((0, 11_000),) + ((1, 70_000),) * 8,
                                      frees_ms=(3000, 4000, 4500, 5000)), preemptible=4)
    behind_one = estimate([batch_work], "short", 13, 100, 32, 0.005, key=(0, 12_000), now_ms=10_000)
    assert behind_one.start_s == pytest.approx(0.005)
    assert decide(now_s=10.0, deadline_s=12.0, est=behind_one, queued=13, max_backlog=100).accept
    # five interactive ahead of it and four rows to take: it waits
    crowd = lanes_stats(LaneStat("short", 5, 4, 0.66, 0.0, order=((0, 11_000),) * 5, frees_ms=(3000,)), preemptible=4)
    assert estimate([crowd], "short", 9, 100, 32, 0.005, key=(0, 12_000), now_ms=10_000).start_s > 3.0
