"""The scheduler's decisions with plain values and a fake clock: no Redis, no torch."""

import pytest

from gpu_worker.dynamic_stage import LONG_ROWS_SPILL_S
from gpu_worker.job import Job
from gpu_worker.lane_queue import LanePolicy
from gpu_worker.running_deadlines import DOOM_OPTIMISM, finish_work_s, stalled
from gpu_worker.scheduler import BatchLimits, Scheduler
from gpu_worker.service_model import ServiceModel

LANES = [LanePolicy("short", 0.010), LanePolicy("long", 0.050)]


def item(i, lane="short", *, arrived=0.0, deadline=100.0, rank=0, tokens=10, prompt=5, size=1, new=0):
    return Job(id=f"r{i}", lane=lane, rank=rank, deadline=deadline, arrived=arrived, tokens=tokens,
               prompt_tokens=prompt, size=size, new_tokens=new)


def running(s, n, lane="short", *, rank=0, deadline=100.0):
    """`n` rows of `lane` in the scheduler's running set."""
    s.started([item(1000 + len(s.running) + i, lane, rank=rank, deadline=deadline) for i in range(n)])


def sched(max_batch=4, max_tokens=1000, **kw):
    return Scheduler(LANES, BatchLimits(max_batch, max_tokens), **kw)


def test_waits_for_the_window_then_takes_the_batch():
    s = sched()
    s.add(item(1, arrived=0.0))
    plan = s.plan(0.005, free_rows=8)
    assert plan.batch == [] and plan.wake_at == pytest.approx(0.010)
    plan = s.plan(0.010, free_rows=8)
    assert [p.id for p in plan.batch] == ["r1"] and plan.lane == "short"


def test_full_batch_closes_the_window_early():
    s = sched(max_batch=3)
    for i in range(3):
        s.add(item(i))
    plan = s.plan(0.0, free_rows=8)
    assert len(plan.batch) == 3


def test_token_budget_closes_the_window_and_caps_the_batch():
    s = sched(max_batch=10, max_tokens=100)
    for i in range(4):
        s.add(item(i, prompt=30))
    plan = s.plan(0.0, free_rows=8)  # 4 x 30 >= 100: ready now
    assert len(plan.batch) == 3  # 3 x 30 fits, 4 x 30 does not
    assert len(s) == 1


def test_a_single_oversized_request_still_runs():
    s = sched(max_tokens=10)
    s.add(item(1, prompt=50))
    assert [p.id for p in s.plan(0.0, free_rows=8).batch] == ["r1"]


def test_batch_never_exceeds_free_rows():
    s = sched(max_batch=8)
    for i in range(8):
        s.add(item(i))
    assert len(s.plan(0.0, free_rows=3).batch) == 3
    assert s.plan(0.0, free_rows=0).batch == []


def test_edf_within_a_lane_and_priority_before_deadline():
    s = sched(max_batch=2)
    s.add(item(1, deadline=50, rank=1))
    s.add(item(2, deadline=30))
    s.add(item(3, deadline=20))
    s.add(item(4, deadline=10, rank=1))
    plan = s.plan(1.0, free_rows=8)
    assert [p.id for p in plan.batch] == ["r3", "r2"]  # interactive first, each by deadline
    assert [p.id for p in s.plan(1.0, free_rows=8).batch] == ["r4", "r1"]


def test_expired_leave_without_compute():
    s = sched()
    s.add(item(1, deadline=0.5))
    s.add(item(2, deadline=5))
    plan = s.plan(1.0, free_rows=8)
    assert [p.id for p in plan.expired] == ["r1"]
    assert [p.id for p in plan.batch] == ["r2"]


def test_expiry_happens_even_without_free_rows():
    s = sched()
    s.add(item(1, deadline=0.5))
    plan = s.plan(1.0, free_rows=0)
    assert [p.id for p in plan.expired] == ["r1"] and plan.batch == []


def test_slack_closes_the_window_early():
    s = sched(service=ServiceModel(fixed_s=0.002, per_token_s=0.0001, decode_s_per_token=0.001))
    s.add(item(1, lane="long", arrived=0.0, deadline=0.080, prompt=20, new=16))  # needs 20 ms; window 50 ms
    plan = s.plan(0.005, free_rows=8)
    # latest start = deadline - 1.5 x 20 ms - 20 ms margin = 30 ms, before the window closes at 50 ms
    assert plan.batch == [] and plan.wake_at == pytest.approx(0.030)
    assert [p.id for p in s.plan(0.0301, free_rows=8).batch] == ["r1"]


def test_short_lane_goes_first_when_both_have_slack():
    s = sched()
    s.add(item(1, "short", arrived=0.9, deadline=10))  # waited 10 of its 10 ms windows
    s.add(item(2, "long", arrived=0.8, deadline=5))  # waited 200 ms = 4 of its 50 ms windows
    assert s.plan(1.0, free_rows=8).lane == "short"
    assert s.plan(1.0, free_rows=8).lane == "long"


def test_a_lane_out_of_slack_goes_first():
    s = sched(service=ServiceModel(decode_s_per_token=0.01))
    s.add(item(1, "short", arrived=0.0, deadline=10))
    s.add(item(2, "long", arrived=0.9, deadline=2.2, new=100))  # needs 1 s; must start by 0.68 with margin
    assert s.plan(1.0, free_rows=1).lane == "long"


def test_aging_prevents_starvation():
    s = sched(aging=1.0)
    s.add(item(1, "long", arrived=0.0, deadline=1000))
    # a steady stream of short requests with tighter deadlines...
    for t in range(1, 2000):
        s.add(item(1000 + t, "short", arrived=float(t), deadline=float(t) + 60))
        plan = s.plan(float(t), free_rows=1)
        if plan.lane == "long":
            break
    # ...does not keep the long request waiting forever: it goes once its wait outweighs the gap
    assert plan.lane == "long" and t < 1000


def promised(i, lane, *, arrived, start_in, deadline=1000.0):
    """A job whose request carries the start the gateway's admission estimated for it."""
    from shared.messages import InferenceRequest
    from shared.states import Priority, Task

    job = item(i, lane, arrived=arrived, deadline=deadline)
    job.request = InferenceRequest(id=job.id, tenant="t", model="m", task=Task.GENERATE, input={}, params={},
                                   lane=lane, priority=Priority.INTERACTIVE, created_ms=int(arrived * 1000),
                                   deadline_ms=int(deadline * 1000), est_tokens=10,
                                   start_eta_ms=int((arrived + start_in) * 1000))
    return job


def test_work_on_the_schedule_admission_promised_lets_short_work_go_first():
    """Under a backlog a long request is told it starts in 30 s; 20 s into that wait it is on schedule, and a short
    request that has waited 50 ms goes first (by waited windows alone the long one would: 400 windows to 5)."""
    s = sched()
    s.add(promised(1, "long", arrived=0.0, start_in=30.0))
    s.add(item(2, "short", arrived=19.95))
    assert s.plan(20.0, free_rows=1).lane == "short"
    # past its promised start it ages like any other: 1 s late is 20 windows, beating a short one 5 windows in
    s.add(item(3, "short", arrived=30.95))
    assert s.plan(31.0, free_rows=1).lane == "long"


def test_the_first_lane_ages_from_arrival_whatever_it_was_promised():
    """A short request whose estimate included a little queue does not yield to longer work until that passes."""
    s = sched()
    s.add(item(1, "long", arrived=19.9))  # 2 windows of 50 ms
    s.add(promised(2, "short", arrived=19.95, start_in=0.5))  # 5 windows of 10 ms since arrival, 45 early
    assert s.plan(20.0, free_rows=1).lane == "short"


def test_without_a_promise_a_request_ages_from_its_arrival():
    s = sched()
    s.add(item(1, "long", arrived=0.0))
    s.add(item(2, "short", arrived=19.95))
    assert s.plan(20.0, free_rows=1).lane == "long"  # 400 windows against 5


def test_cancel_removes_a_waiting_request():
    s = sched()
    s.add(item(1))
    s.add(item(2))
    assert s.cancel("r1").id == "r1"
    assert s.cancel("r1") is None
    assert [p.id for p in s.plan(1.0, free_rows=8).batch] == ["r2"]


def test_unknown_lane_falls_back_to_the_last():
    s = sched()
    s.add(item(1, lane="gone"))
    assert s.backlog() == {"short": 0, "long": 1}


def test_size_counts_rows_for_embeddings():
    s = sched(max_batch=4)
    s.add(item(1, size=3))
    s.add(item(2, size=3))
    plan = s.plan(0.0, free_rows=4)  # 6 rows waiting >= 4: ready
    assert [p.id for p in plan.batch] == ["r1"]


def test_drain_returns_everything():
    s = sched()
    for i in range(5):
        s.add(item(i, "short" if i % 2 else "long"))
    assert sorted(p.id for p in s.drain()) == [f"r{i}" for i in range(5)]
    assert len(s) == 0


def test_service_estimate_counts_prefill_and_decode():
    model = ServiceModel(fixed_s=0.01, per_token_s=0.001, decode_s_per_token=0.02)
    assert model.estimate(item(1, prompt=100, new=10)) == pytest.approx(0.01 + 0.1 + 0.2)
    assert model.estimate(item(2, prompt=10, size=4)) == pytest.approx(0.01 + 0.04)  # an encoder batch of 4


def test_fifo_baseline_ignores_deadlines_and_priorities():
    s = sched(max_batch=8, deadline_aware=False)
    s.add(item(1, arrived=0.0, deadline=0.5, rank=1))
    s.add(item(2, arrived=0.1, deadline=0.2))
    s.add(item(3, arrived=0.2, deadline=50))
    plan = s.plan(1.0, free_rows=8)
    assert plan.expired == [] and [p.id for p in plan.batch] == ["r1", "r2", "r3"]


def test_urgent_interactive_work_asks_for_preemption_of_batch_rows():
    s = sched(service=ServiceModel(decode_s_per_token=0.01))
    s.add(item(1, arrived=0.0, deadline=1.0, new=50))  # needs 0.5 s: must start by 0.5
    assert s.plan(0.3, free_rows=0).preempt == []  # nothing to give back
    running(s, 3, rank=1)
    assert s.plan(0.1, free_rows=0).preempt == []  # still has slack
    assert len(s.plan(0.3, free_rows=0).preempt) == 1
    s.add(item(2, arrived=0.0, deadline=1.0, new=50, rank=1))
    assert len(s.plan(0.3, free_rows=0).preempt) == 1  # batch work never preempts


def test_requests_that_cannot_finish_in_time_expire_without_compute():
    s = sched(service=ServiceModel(decode_s_per_token=0.01))
    s.add(item(1, arrived=0.0, deadline=1.0, new=50))  # needs 0.5 s
    s.add(item(2, arrived=0.0, deadline=1.0, new=5))  # needs 0.05 s
    plan = s.plan(0.6, free_rows=0)
    assert [p.id for p in plan.expired] == ["r1"] and len(s) == 1


def shared_sched(share=0.5, total=8, **kw):
    lanes = [LanePolicy("short", 0.0), LanePolicy("long", 0.0, max_share=share)]
    return Scheduler(lanes, BatchLimits(16, 100_000), total_rows=total, **kw)


@pytest.mark.parametrize(("running_long", "free", "expected"), [
    (0, 8, 4),  # half of 8 rows
    (3, 5, 1),  # one left of its share
    (4, 4, 0),  # at its share: waits though rows are free
    (0, 2, 2),  # fewer free rows than its share
])
def test_a_lane_never_takes_more_than_its_share_of_rows(running_long, free, expected):
    s = shared_sched()
    for i in range(10):
        s.add(item(i, "long"))
    running(s, running_long, "long")
    plan = s.plan(1.0, free_rows=free)
    assert len(plan.batch) == expected
    assert all(p.lane == "long" for p in plan.batch)


def test_rows_kept_back_from_a_capped_lane_go_to_the_others():
    s = shared_sched()
    for i in range(10):
        s.add(item(i, "long", arrived=0.0))
    first = s.plan(1.0, free_rows=8).batch
    assert len(first) == 4
    # long work holds its share: a short request arriving later still finds a row at once
    s.add(item(99, "short", arrived=2.0))
    s.started(first)
    plan = s.plan(2.0, free_rows=4)
    assert [p.id for p in plan.batch] == ["r99"]


def test_a_tiny_share_still_allows_one_row_and_no_share_without_a_row_count():
    s = shared_sched(share=0.01)
    for i in range(3):
        s.add(item(i, "long"))
    assert len(s.plan(1.0, free_rows=8).batch) == 1
    s = Scheduler([LanePolicy("long", 0.0, max_share=0.5)], BatchLimits(16, 100_000))  # rows unknown
    for i in range(3):
        s.add(item(i, "long"))
    assert len(s.plan(1.0, free_rows=8).batch) == 3


def long_rows_sched(long_rows=3, **kw):
    lanes = [LanePolicy("short", 0.0), LanePolicy("medium", 0.0), LanePolicy("long", 0.0)]
    return Scheduler(lanes, BatchLimits(16, 100_000), total_rows=16, long_rows=long_rows, **kw)


@pytest.mark.parametrize(("medium", "long", "expected"), [
    (0, 0, 3),  # the bound
    (2, 0, 1),  # the lanes after the first count together
    (1, 1, 1),
    (0, 3, 0),  # at the bound: waits though rows are free
    (0, 5, 0),  # above it (rows taken while the queue was backed up): still waits
])
def test_the_lanes_after_the_first_hold_long_rows_together(medium, long, expected):
    s = long_rows_sched()
    for i in range(10):
        s.add(item(i, "medium", arrived=0.9))
    running(s, medium, "medium")
    running(s, long, "long")
    running(s, 4, "short")  # the first lane's rows do not count
    plan = s.plan(1.0, free_rows=8)
    assert len(plan.batch) == expected and all(p.lane == "medium" for p in plan.batch)


def test_the_first_lane_is_never_held_to_long_rows():
    s = long_rows_sched(long_rows=1)
    running(s, 5, "long")
    for i in range(6):
        s.add(item(i, "short"))
    assert len(s.plan(1.0, free_rows=8).batch) == 6


@pytest.mark.parametrize(("arrived", "expected"), [
    (1.0 - LONG_ROWS_SPILL_S + 0.01, 0),  # waited just under the spill: held
    (1.0 - LONG_ROWS_SPILL_S, 8),  # backed up: the free rows, so a saturated model runs a full batch
])
def test_a_backed_up_lane_takes_the_free_rows_beyond_long_rows(arrived, expected):
    s = long_rows_sched()
    running(s, 3, "long")
    for i in range(10):
        s.add(item(i, "long", arrived=arrived if i == 0 else 0.9))
    assert len(s.plan(1.0, free_rows=8).batch) == expected


def test_a_request_out_of_slack_lifts_long_rows_and_fifo_keeps_the_bound():
    s = long_rows_sched(service=ServiceModel(fixed_s=0.5))
    running(s, 3, "long")
    s.add(item(1, "long", arrived=0.9, deadline=100.0))
    assert s.plan(1.0, free_rows=8).batch == []
    s.add(item(2, "long", arrived=0.9, deadline=1.7))  # must start now to finish in time
    assert {p.id for p in s.plan(1.0, free_rows=8).batch} == {"r1", "r2"}
    s = long_rows_sched(deadline_aware=False)  # the FIFO baseline: no slack, the waiting time alone
    running(s, 3, "long")
    s.add(item(1, "long", arrived=0.9, deadline=1.5))
    assert s.plan(1.0, free_rows=8).batch == []


def test_long_rows_and_a_lane_share_both_bound_and_none_bounds_nothing():
    lanes = [LanePolicy("short", 0.0), LanePolicy("long", 0.0, max_share=0.25)]
    s = Scheduler(lanes, BatchLimits(16, 100_000), total_rows=16, long_rows=10)
    for i in range(10):
        s.add(item(i, "long", arrived=0.9))
    assert len(s.plan(1.0, free_rows=16).batch) == 4  # the share (4 of 16) is the tighter
    s = long_rows_sched(long_rows=None)
    running(s, 6, "long")
    for i in range(10):
        s.add(item(i, "long", arrived=0.9))
    assert len(s.plan(1.0, free_rows=8).batch) == 8


# --- decisions about running rows, hold-offs and yielding (all in the scheduler) --------------------

def measured(s, per_row_s=0.01):
    """The scheduler's tracker has seen enough decode steps: `per_row_s` per running row."""
    for rows in (1, 2, 4, 8, 1, 2, 4, 8):
        s.tracker.observe_step(rows, per_row_s * rows)


def test_a_running_row_past_its_deadline_is_evicted():
    s = sched()
    s.started([item(1, deadline=1.0), item(2, deadline=5.0)])
    plan = s.plan(1.0, free_rows=2, left={"r1": 3, "r2": 3})
    assert [j.id for j in plan.evict] == ["r1"]


def waiting(s, i=99):
    """Work waiting for a row: what an unfinishable running row is evicted for."""
    s.add(item(i, arrived=0.0, deadline=1000.0))


def test_a_running_row_that_cannot_fit_its_remaining_tokens_is_evicted_before_its_deadline():
    s = sched()
    measured(s)  # 2 rows: 20 ms a token
    s.started([item(1, deadline=1.0), item(2, deadline=100.0)])
    waiting(s)
    # 100 tokens left at 20 ms: 2 s (1.6 s at the optimism factor) > 0.9 s left
    plan = s.plan(0.1, free_rows=2, left={"r1": 100, "r2": 100})
    assert [j.id for j in plan.evict] == ["r1"]
    # 40 tokens: 0.64 s of the 0.9 s left: it stays
    assert s.plan(0.1, free_rows=2, left={"r1": 40, "r2": 40}).evict == []


def test_a_cold_fit_judges_only_the_next_step():
    """Two steps seen (one row, then three with two joiners' prefill in the interval): the fit extrapolates
    proportionally and would read 200 tokens as over a minute. Rows with 40 s of work and 59 s left stay
    until the fit is warm (CI: batchgate up evicted three such echo rows after two steps); a row whose next
    step cannot fit its deadline still leaves before it."""
    s = sched()
    s.tracker.observe_step(1, 0.2)
    s.tracker.observe_step(3, 0.4)
    assert DOOM_OPTIMISM * 199 * s.tracker.doom_step_seconds(3) > 59.0  # what the cold fit would say
    s.started([item(1, deadline=59.0), item(2, deadline=59.0), item(3, deadline=0.3)])
    plan = s.plan(0.0, free_rows=2, left={"r1": 199, "r2": 199, "r3": 1})
    assert [j.id for j in plan.evict] == ["r3"]  # its next step (0.675 s with the margin) ends past 0.3 s
    for _ in range(8):  # warm: the steps are flat in the rows, as an echo model's and a GPU's are
        s.tracker.observe_step(3, 0.2)
    assert s.plan(0.0, free_rows=2, left={"r1": 199, "r2": 199}).evict == []
    for _ in range(70):  # a lasting 0.5 s a token, whatever the rows, is judged on the whole: 80 s of work
        for rows in (1, 2, 3):
            s.tracker.observe_step(rows, 0.5)
    waiting(s)
    assert {j.id for j in s.plan(0.0, free_rows=2, left={"r1": 199, "r2": 199}).evict} == {"r1", "r2"}


def test_a_spell_of_slow_steps_does_not_condemn_a_row_the_averaged_interval_lets_finish():
    """Admission forecast the row at the averaged token interval; the moment's moves faster. A row is evicted when
    it cannot finish at the better of the two: not for a spell of slow steps, but once the slowdown lasts."""
    s = sched()
    for _ in range(60):
        measured(s)  # 10 ms a token per row, long enough for the averaged interval to know it
    for _ in range(20):  # a spell three times slower, as under a burst of other load
        s.tracker.observe_step(2, 0.06)
    fast, slow = s.tracker.step_seconds(2), s.tracker.forecast_step_seconds(2)
    assert fast > 1.5 * slow  # the moment's interval moved, the averaged one hardly
    n = 100
    s.started([item(1, deadline=DOOM_OPTIMISM * n * (fast + slow) / 2), item(2, deadline=100.0)])
    assert s.plan(0.0, free_rows=2, left={"r1": n, "r2": n}).evict == []  # it fits at the averaged interval
    for _ in range(400):  # the slowdown lasts: the averaged interval learns it too
        s.tracker.observe_step(2, 0.06)
    waiting(s)
    assert [j.id for j in s.plan(0.0, free_rows=2, left={"r1": n, "r2": n}).evict] == ["r1"]


def test_a_row_whose_next_step_would_end_past_its_deadline_leaves_before_it():
    """The optimism factor is for the tokens after the next one: the next step is counted in full, with a margin, so a
    row is not stepped into its deadline and written as a success past it (CI: an echo row finished past its deadline
    by its last step)."""
    s = sched()
    for _ in range(4):
        for rows in (1, 2, 3):
            s.tracker.observe_step(rows, 0.03)  # 30 ms a step, flat in the rows (as an echo model's, a GPU's)
    step = s.tracker.step_seconds(3)
    # 80% of a step fits r1, not a step; a step fits r3, not with room for it to run long; r2 has two steps
    s.started([item(1, deadline=0.9 * step), item(2, deadline=2 * step), item(3, deadline=1.2 * step)])
    assert [j.id for j in s.plan(0.0, free_rows=2, left={"r1": 1, "r2": 1, "r3": 1}).evict] == ["r1", "r3"]


def test_with_nothing_waiting_a_row_that_cannot_finish_steps_on_until_its_last_step():
    """Evicting a row that cannot finish frees its row for waiting work; with none waiting it gains no one anything:
    the row keeps stepping, its partial output growing, until its next step would end past its deadline (an idle
    worker evicted 10 sampled rows of 128 tokens after 7 tokens, where they would have made 124 by their deadline)."""
    s = sched()
    measured(s)  # 2 rows: 20 ms a token
    s.started([item(1, deadline=1.0), item(2, deadline=100.0)])
    assert s.plan(0.1, free_rows=2, left={"r1": 100, "r2": 100}).evict == []  # 1.6 s of work, 0.9 s left: on
    assert s.plan(0.96, free_rows=2, left={"r1": 60, "r2": 60}).evict == []  # its next step (30 ms) still fits
    assert [j.id for j in s.plan(0.975, free_rows=2, left={"r1": 59, "r2": 59}).evict] == ["r1"]  # it would not
    waiting(s)  # work arrives: now the row that cannot finish leaves for it
    s2 = sched()
    measured(s2)
    s2.started([item(1, deadline=1.0), item(2, deadline=100.0)])
    waiting(s2)
    assert [j.id for j in s2.plan(0.1, free_rows=2, left={"r1": 100, "r2": 100}).evict] == ["r1"]


def test_with_nothing_waiting_no_row_leaves_before_its_last_step_even_beside_rows_that_could_finish():
    """"Cannot finish" counts every token up to `max_new_tokens`, where most generations stop sooner: with nothing
    waiting, no row is evicted on that forecast, not even one whose steps slow another's (evicting three rows so
    that seven might finish ended the seven cut short as well)."""
    s = sched(max_batch=8)
    measured(s)  # 10 ms a token per row
    # r1: 20 tokens by 0.5 s: fits at 2 rows (0.33 s), not at 3 (0.50 s); r2, r3: 200 tokens by 1 s: never
    s.started([item(1, deadline=0.5), item(2, deadline=1.0), item(3, deadline=1.1)])
    assert s.plan(0.0, free_rows=2, left={"r1": 20, "r2": 200, "r3": 200}).evict == []
    waiting(s)  # with work waiting: the two that cannot finish leave, r1 finishes
    assert {j.id for j in s.plan(0.0, free_rows=2, left={"r1": 20, "r2": 200, "r3": 200}).evict} == {"r2", "r3"}


def test_rows_that_cannot_finish_beside_all_the_others_are_kept_as_far_as_they_can_finish_beside_fewer():
    """Ten rows, one able to finish at the 10-row interval: evicting the other nine leaves rows idle that seven of
    them could have finished in; the most that can finish beside one another stay (those that finish beside all
    first, then those with the fewest tokens left) and the rest leave for the waiting work."""
    s = sched(max_batch=16)
    measured(s)  # 10 ms a token per row: 100 ms at 10 rows, 60 ms at 6
    s.started([item(i, deadline=1.0) for i in range(10)])
    left = {f"r{i}": 10 + i for i in range(10)}  # 10-19 tokens: at 7 rows the first seven fit 1 s, at 8 five
    waiting(s)
    plan = s.plan(0.0, free_rows=0, left=left)
    kept = set(left) - {j.id for j in plan.evict}
    assert kept == {f"r{i}" for i in range(7)}
    assert all(finish_work_s(left[r], s.tracker.step_seconds(7), s.tracker.doom_step_seconds(7)) <= 1.0 for r in kept)
    assert sum(finish_work_s(n, s.tracker.step_seconds(8), s.tracker.doom_step_seconds(8)) <= 1.0
               for n in left.values()) < 8


def test_a_cold_fit_does_not_hold_back_a_prefill_for_a_row_it_misjudges():
    """Two steps seen, the fit reads a row's 199 tokens as ~24 s of work; with its deadline just past that, judging
    the whole work said a 100 ms prefill would push it past, and held the new work back. Cold, only the row's next
    step is judged, so the prefill goes ahead; warm, the same judgement holds it back."""
    s = sched()
    s.tracker.observe_step(1, 0.2)
    s.tracker.observe_step(3, 0.4)
    for _ in range(8):
        s.tracker.observe_prefill(100, 0.1)
    whole = finish_work_s(199, s.tracker.step_seconds(1), s.tracker.doom_step_seconds(1))
    running_rows, new = {"r1": item(1, deadline=whole + 0.05)}, [item(3, prompt=100, deadline=100.0)]
    assert not stalled(running_rows, {"r1": 199}, 0.0, s.tracker, new, lambda j: 50.0)
    warm = sched()
    for _ in range(8):
        warm.tracker.observe_step(1, 0.15)  # warm, at the interval the cold fit read
        warm.tracker.observe_prefill(100, 0.1)
    whole = finish_work_s(199, warm.tracker.step_seconds(1), warm.tracker.doom_step_seconds(1))
    running_rows = {"r1": item(1, deadline=whole + 0.05)}
    assert stalled(running_rows, {"r1": 199}, 0.0, warm.tracker, new, lambda j: 50.0)


def finishing_row(s):
    """20 ms steps at 2 rows, 1 ms of prefill a prompt token; r1 has one token left and 45 ms to its deadline."""
    measured(s)
    for _ in range(8):
        s.tracker.observe_prefill(100, 0.1)
    s.refresh_estimates()
    s.started([item(1, deadline=0.045), item(2, deadline=100.0)])


@pytest.mark.parametrize("prompt, waits", [(100, True), (5, False)])
def test_a_prefill_that_would_push_a_finishing_row_past_its_deadline_waits_a_step(prompt, waits):
    s = sched(max_batch=4)
    finishing_row(s)
    s.add(item(3, arrived=-1.0, prompt=prompt, deadline=100.0))  # 100 ms of prefill before r1's token, or 5 ms
    plan = s.plan(1e-3, free_rows=2, left={"r1": 1, "r2": 50})
    assert plan.evict == [] and [j.id for j in plan.batch] == ([] if waits else ["r3"])
    if waits:
        s.finished("r1")  # the step ran, r1 finished in time: now the batch starts
        assert [j.id for j in s.plan(0.02, free_rows=3, left={"r2": 49}).batch] == ["r3"]


def test_a_prefill_at_its_last_chance_to_start_does_not_wait_for_a_finishing_row():
    s = sched(max_batch=4)
    finishing_row(s)
    late = item(3, arrived=-1.0, prompt=100, tokens=110, new=10, deadline=0.0)
    late.deadline = 1e-3 + 0.5 * s.tracker.step_seconds(2) - s.latest_start(late)  # its last start: in half a step
    s.add(late)
    plan = s.plan(1e-3, free_rows=2, left={"r1": 1, "r2": 50})
    assert [j.id for j in plan.batch] == ["r3"]


def test_the_fifo_baseline_evicts_nothing():
    s = sched(deadline_aware=False)
    s.started([item(1, deadline=1.0)])
    assert s.plan(5.0, free_rows=3, left={"r1": 10}).evict == []


def test_evicted_rows_free_their_rows_for_waiting_work_in_the_same_plan():
    s = sched(max_batch=4)
    s.started([item(1, deadline=1.0)])
    s.add(item(2, arrived=0.0, deadline=100.0))
    plan = s.plan(2.0, free_rows=0, left={"r1": 5})
    assert [j.id for j in plan.evict] == ["r1"] and [j.id for j in plan.batch] == ["r2"]


def test_new_rows_only_while_every_running_row_keeps_its_deadline():
    s = sched(max_batch=8, total_rows=8)
    measured(s)  # a step costs 10 ms per row
    s.started([item(0, deadline=0.45)])  # 10 tokens in 0.45 s: at most 4 rows (40 ms a token)
    assert s._deadline_room(0.0, {"r0": 10}, free_rows=7) == 3
    for i in range(1, 8):
        s.add(item(i, arrived=0.0))
    assert len(s.plan(0.02, free_rows=7, left={"r0": 10}).batch) == 3  # once the short lane's window closed
    assert s._deadline_room(0.0, {}, free_rows=7) == 8  # no running row: no limit but the rows


def test_a_yielding_turn_starts_nothing_until_work_has_waited_then_one():
    from gpu_worker.scheduler import BACKGROUND_PREFILL_WAIT_S

    s = sched(max_batch=8)
    for i in range(3):
        s.add(item(i, arrived=1.0))
    assert s.plan(1.1, free_rows=8, yielding=True).batch == []
    assert len(s.plan(1.0 + BACKGROUND_PREFILL_WAIT_S, free_rows=8, yielding=True).batch) == 1
    assert len(s.plan(2.0, free_rows=8).batch) == 2  # not yielding: every row it may take


def test_hold_starts_nothing_and_preempts_nothing_until_it_ends():
    s = sched(service=ServiceModel(decode_s_per_token=0.01))
    s.add(item(1, arrived=0.0, deadline=1.0, new=50))
    s.hold(0.45)
    assert s.plan(0.3, free_rows=4).batch == []
    running(s, 2, rank=1)
    assert s.plan(0.4, free_rows=0).preempt == []  # out of slack, but holding: no preemption either
    assert len(s.plan(0.45, free_rows=0).preempt) == 1  # the same plan once the hold has ended
    assert [j.id for j in s.plan(0.45, free_rows=4).batch] == ["r1"]
    s.hold(float("inf"))  # draining
    s.add(item(2, arrived=0.0))
    assert s.plan(10.0, free_rows=4).batch == []


def test_late_finds_jobs_past_their_deadline_only_when_deadline_aware():
    batch = [item(1, deadline=1.0), item(2, deadline=3.0)]
    assert [j.id for j in sched().late(batch, 2.0)] == ["r1"]
    assert sched(deadline_aware=False).late(batch, 2.0) == []


def test_job_states_follow_the_scheduler_and_count_attempts():
    from gpu_worker.job import JobState

    s = sched()
    job = item(1)
    s.add(job)
    assert job.state is JobState.QUEUED
    (taken,) = s.plan(1.0, free_rows=4).batch
    s.started([taken])
    assert taken.state is JobState.RUNNING and taken.attempts == 1 and s.running == {"r1": taken}
    s.requeue([taken])  # preempted: waits again
    assert taken.state is JobState.QUEUED and not s.running and len(s) == 1
    s.started(s.plan(2.0, free_rows=4).batch)
    assert taken.attempts == 2
    assert s.finished("r1") is taken and taken.state is JobState.DONE and s.finished("r1") is None


@pytest.mark.parametrize(("deadline", "now", "work", "cannot"), [
    (10.0, 9.0, 0.0, False),
    (10.0, 10.0, 0.0, True),  # at the deadline is too late
    (10.0, 9.0, 0.5, False),
    (10.0, 9.0, 1.0, True),
    (10.0, 11.0, 0.0, True),
])
def test_cannot_finish_is_the_one_feasibility_rule(deadline, now, work, cannot):
    from shared.deadlines import cannot_finish

    assert cannot_finish(deadline, now, work) is cannot


# --- chunked prefill: a step's prefill budget while rows decode ------------------------------------------

def chunky(budget=64, **kw):
    return Scheduler([LanePolicy("short", 0.0), LanePolicy("long", 0.0)], BatchLimits(8, 4096),
                     chunk_tokens=budget, **kw)


def test_a_long_prompt_beside_decoding_rows_is_prefilled_in_chunks():
    s = chunky()
    running(s, 2)  # rows decoding
    s.add(item(1, "long", prompt=500))
    plan = s.plan(1.0, free_rows=4)
    assert plan.chunked is not None and plan.chunked.id == "r1" and plan.batch == []
    assert plan.chunk_tokens == 64


def test_with_no_row_decoding_a_long_prompt_is_prefilled_whole():
    s = chunky()
    s.add(item(1, "long", prompt=500))
    plan = s.plan(1.0, free_rows=4)
    assert plan.chunked is None and [j.id for j in plan.batch] == ["r1"]
    assert plan.chunk_tokens == 4096  # nothing to protect: a chunk in progress finishes at once


def test_prompts_that_fit_the_budget_batch_within_it():
    s = chunky(budget=64)
    running(s, 2)
    for i in range(4):
        s.add(item(i, prompt=20))
    assert len(s.plan(1.0, free_rows=8).batch) == 3  # 3 x 20 <= 64 < 4 x 20


def test_while_a_prompt_is_chunked_short_work_still_starts_and_long_work_waits():
    s = chunky(budget=64)
    running(s, 2)
    s.started([item(50, "long", prompt=500)])  # the prompt being chunked
    s.add(item(1, "long", prompt=400))
    s.add(item(2, "short", prompt=16))
    plan = s.plan(1.0, free_rows=4, chunking=True)
    assert [j.id for j in plan.batch] == ["r2"] and plan.chunked is None
    assert plan.chunk_tokens == 64 - 16  # the new prompt first within the step's budget, the chunk the rest
    assert s.plan(1.0, free_rows=4, chunking=True).batch == []  # the long one waits for the chunk in progress


def test_no_chunking_for_an_encoder_or_when_switched_off():
    s = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 4096))  # chunk_tokens None
    running(s, 2)
    s.add(item(1, prompt=500))
    plan = s.plan(1.0, free_rows=4)
    assert plan.chunked is None and [j.id for j in plan.batch] == ["r1"]


def test_beside_a_busy_foreground_engine_long_work_starts_at_once_in_small_chunks():
    """A background engine's turn beside a busy foreground engine prefills at most BACKGROUND_CHUNK_TOKENS,
    new prompts and long ones in chunks, even with no row of its own decoding; with such a bound it does not
    hold prefills back while yielding."""
    from gpu_worker.prefill_budget import BACKGROUND_CHUNK_TOKENS, BACKGROUND_IDLE_CHUNK_TOKENS

    s = chunky(budget=512)
    s.add(item(1, "long", prompt=256, arrived=1.0))
    plan = s.plan(1.0, free_rows=4, yielding=True)
    assert plan.chunked is not None and plan.chunked.id == "r1"
    assert plan.chunk_tokens == BACKGROUND_CHUNK_TOKENS
    s.started([plan.chunked])
    for i in range(2, 6):
        s.add(item(i, "long", prompt=20, arrived=1.0))
    plan = s.plan(1.0, free_rows=4, yielding=True, chunking=True)
    assert [j.id for j in plan.batch] == ["r2", "r3", "r4"]  # 3 x 20 <= 64 < 4 x 20, no wait for yielding
    assert s.plan(1.0, free_rows=4, chunking=True).chunk_tokens == 4096  # a lone engine, no row decoding here
    assert s.plan(1.0, free_rows=4, chunking=True, background=True).chunk_tokens == BACKGROUND_IDLE_CHUNK_TOKENS


def test_the_background_bound_never_exceeds_the_configured_chunk():
    assert chunky(budget=32).step_budget(False, background=True) == 32
    assert chunky(budget=32).step_budget(False, yielding=True) == 32
    assert chunky(budget=0).step_budget(False, background=True) is None  # chunked prefill off


def test_interactive_prompts_are_never_prefilled_with_batch_work():
    s = sched(max_batch=8)
    s.add(item(1, rank=0))
    for i in range(2, 6):
        s.add(item(i, rank=1))
    assert [p.id for p in s.plan(1.0, free_rows=8).batch] == ["r1"]
    assert [p.id for p in s.plan(1.0, free_rows=8).batch] == ["r2", "r3", "r4", "r5"]


def test_batch_work_starts_within_the_rows_and_prefill_tokens_it_is_given():
    s = sched(max_batch=8)
    for i in range(6):
        s.add(item(i, rank=1, prompt=10))
    s.background_rows = 0
    plan = s.plan(1.0, free_rows=8)
    assert plan.batch == [] and plan.lane is None  # the lane is not ready while its head may not start
    s.background_rows, s.background_tokens = 3, None
    assert len(s.plan(1.0, free_rows=8).batch) == 3
    s.background_rows, s.background_tokens = None, 20
    assert len(s.plan(1.0, free_rows=8).batch) == 2  # 2 rows x 10 tokens
    s.add(item(9, rank=0, prompt=10))
    s.background_rows = 0
    assert [p.id for p in s.plan(1.0, free_rows=8).batch] == ["r9"]  # interactive work is not bound by either
