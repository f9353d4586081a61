"""What a compute loop publishes for admission beside its counts (`gpu_worker.load_outlook`), pure."""

from __future__ import annotations

from gpu_worker.job import Job
from gpu_worker.load_outlook import FREES_KEPT, ORDER_SAMPLES, preemptible, row_frees_ms, waiting_order


def job(i: int, *, rank: int = 0, deadline: float = 100.0, lane: str = "short") -> Job:
    return Job(id=f"r{i}", lane=lane, rank=rank, deadline=deadline, arrived=0.0, tokens=10, prompt_tokens=1,
               new_tokens=9)


def test_the_waiting_order_is_the_lane_queues_sampled_evenly_when_long():
    jobs = [job(0, rank=1, deadline=5.0), job(1, deadline=30.0), job(2, deadline=20.0)]
    assert waiting_order(jobs) == ((0, 20_000), (0, 30_000), (1, 5_000))  # interactive first, then by deadline
    many = [job(i, deadline=float(i)) for i in range(10 * ORDER_SAMPLES)]
    keys = waiting_order(reversed(many))
    assert len(keys) == ORDER_SAMPLES and list(keys) == sorted(keys)
    assert keys[0] == (0, 0) and keys[-1] == (0, (10 * ORDER_SAMPLES - 1) * 1000)  # both ends kept
    assert waiting_order([]) == ()


def test_a_running_row_ends_after_its_tokens_left_or_at_its_deadline():
    running = [job(0, deadline=1010.0), job(1, deadline=1000.5), job(2, deadline=1010.0, lane="long"),
               job(3, deadline=1010.0)]
    ends = row_frees_ms(running, {"r0": 100, "r1": 100, "r2": 20}, now=1000.0, step_s=0.02)
    # r0: 100 tokens at 20 ms; r1: cut at its deadline, 0.5 s away; r3: tokens unknown, its next step
    assert ends == {"short": [20, 500, 2000], "long": [400]}
    past = row_frees_ms([job(0, deadline=999.0)], {"r0": 5}, now=1000.0, step_s=0.02)
    assert past == {"short": [0]}
    crowd = row_frees_ms([job(i) for i in range(2 * FREES_KEPT)], {f"r{i}": i + 1 for i in range(2 * FREES_KEPT)},
                         now=0.0, step_s=0.001)
    assert crowd["short"] == [i + 1 for i in range(FREES_KEPT)]  # the soonest ones


def test_batch_priority_rows_are_the_preemptible_ones():
    assert preemptible([job(0, rank=1), job(1), job(2, rank=1)]) == 2


def test_a_row_is_counted_to_end_where_its_lanes_generations_usually_end_until_it_passes_that():
    """A lane whose generations end by themselves at a fifth of their max_new_tokens (a model's EOS): a row of 100
    that has made 10 is counted to end after 10 more, not 90; one past 20 may run to its max."""
    young, old = job(0), job(1)
    young.new_tokens = old.new_tokens = 100
    ends = row_frees_ms([young, old], {"r0": 90, "r1": 70}, now=0.0, step_s=0.01, stop_share={"short": 0.2})
    assert ends == {"short": [100, 700]}
    assert row_frees_ms([young], {"r0": 90}, now=0.0, step_s=0.01) == {"short": [900]}  # none measured: its max


def test_a_generation_that_ended_by_itself_tells_the_share_of_its_max_it_made():
    from gpu_worker.outcomes import Outcome
    from shared.messages import RequestResult
    from shared.states import FinishReason, Status
    from tests.fakes import make_request

    req = make_request("r")  # max_new_tokens 4

    def share(reason: FinishReason, made: int | None = 1) -> float | None:
        output = None if made is None else {"completion_tokens": made}
        return Outcome(req, RequestResult(id="r", status=Status.SUCCEEDED, output=output,
                                          finish_reason=reason)).stop_share

    assert share(FinishReason.EOS) == 0.25 and share(FinishReason.STOP, 2) == 0.5
    assert share(FinishReason.LENGTH, 4) == 1.0
    assert share(FinishReason.DEADLINE) is None and share(FinishReason.CANCELLED) is None  # cut short
    assert share(FinishReason.EOS, None) is None


def test_a_lanes_stop_share_follows_its_generations_that_ended_by_themselves():
    from gpu_worker.service_model import ServiceTracker

    tracker = ServiceTracker(("short",))
    assert tracker.counters["short"].stop_share == 1.0  # nothing seen: every row runs to its max
    for _ in range(60):
        tracker.observe_completion("short", 0.2)
    tracker.observe_completion("short")  # one cut short: says nothing of where generations end
    assert abs(tracker.counters["short"].stop_share - 0.2) < 0.01 and tracker.counters["short"].completed == 61
