"""How batch-priority rows share the running batch with interactive rows (pure)."""

from __future__ import annotations

from gpu_worker import background_rows as br
from gpu_worker.job import Job

NOW = 1000.0


def job(i: str, rank: int, deadline: float = NOW + 3600) -> Job:
    return Job(id=i, lane="short", rank=rank, deadline=deadline, arrived=NOW, tokens=10, prompt_tokens=5)


def cpu(rows: int) -> float:  # a CPU's step: every row costs
    return 0.015 + 0.001 * rows


def gpu(rows: int) -> float:  # a GPU's step: about flat
    return 0.015 + 0.000001 * rows


def test_batch_rows_all_step_without_interactive_rows_or_before_the_cost_is_measured():
    assert br.stepping_background(0, 40, cpu) == 40
    assert br.stepping_background(2, 40, lambda _: 0.0) == 40


def test_batch_rows_step_as_far_as_the_allowance_reaches():
    # one interactive row: 16 ms; 10% more allows 1.6 ms: one more row (17 ms) fits, two (18 ms) do not
    assert br.stepping_background(1, 40, cpu) == 1
    assert br.stepping_background(1, 40, gpu) == 40
    assert br.stepping_background(20, 40, cpu) == 3  # 35 ms * 1.1 = 38.5 ms: three more rows
    assert br.stepping_background(1, 0, cpu) == 0


def test_no_interactive_rows_nothing_sits_out_and_batch_work_leaves_the_reserve_free():
    running = [job(f"b{i}", 1) for i in range(30)]
    s = br.share(running, {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert s.hold == frozenset() and s.start_rows == 64 - 4 - 30
    full = [job(f"b{i}", 1) for i in range(60)]
    assert br.share(full, {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02).start_rows == 0
    assert br.reserved_rows(64) == 4 and br.reserved_rows(8) == 0


def test_beside_interactive_rows_batch_rows_sit_out_and_none_start():
    running = [job("i0", 0)] + [job(f"b{i}", 1, NOW + 3600 + i) for i in range(30)]
    left = {f"b{i}": 50 for i in range(30)}
    s = br.share(running, left, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert len(s.hold) == 29 and "b0" not in s.hold  # the earliest deadline steps
    assert s.start_rows == 0
    # on a GPU every batch row steps beside it, and more may start
    g = br.share(running, left, set(), NOW, total_rows=64, step_s=gpu, interval_s=0.02)
    assert g.hold == frozenset() and g.start_rows == 64 - 4 - 30


def test_rows_already_stepping_keep_stepping():
    running = [job("i0", 0)] + [job(f"b{i}", 1, NOW + 3600 + i) for i in range(5)]
    held = {"b0", "b1", "b2", "b3"}  # b4 was the one stepping
    s = br.share(running, {}, held, NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert s.hold == frozenset(held)


def test_a_batch_row_near_its_deadline_steps_anyway():
    # 100 tokens left at 20 ms: 2 s of work, 4 s with the margin, and its deadline is 3 s away
    running = [job("i0", 0), job("late", 1, NOW + 3.0)] + [job(f"b{i}", 1) for i in range(5)]
    left = {"late": 100}
    s = br.share(running, left, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert "late" not in s.hold and len(s.hold) == 5  # it took the one stepping place
    s = br.share(running, left, set(), NOW, total_rows=64, step_s=lambda n: 0.015 + 0.1 * n, interval_s=0.02)
    assert "late" not in s.hold and len(s.hold) == 5  # even where the allowance admits none


def test_free_stepping_places_let_batch_work_start():
    running = [job(f"i{i}", 0) for i in range(20)]
    s = br.share(running, {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert s.hold == frozenset() and s.start_rows == 3


def test_a_rounds_batch_prefill_costs_about_a_decode_step():
    # 40 ms a step; prefill 5 ms fixed + 0.25 ms a token: 140 tokens
    assert br.prefill_tokens(0.040, (0.005, 0.00025)) == 140
    assert br.prefill_tokens(0.004, (0.005, 0.00025)) == br.MIN_PREFILL_TOKENS
    assert br.prefill_tokens(0.0, (0.005, 0.00025)) is None and br.prefill_tokens(0.04, (0.0, 0.0)) is None
    s = br.share([job("b0", 1)], {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02,
                 prefill=(0.005, 0.00025))
    assert s.prefill_tokens == int((cpu(1) - 0.005) / 0.00025)
