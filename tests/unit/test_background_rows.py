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


def fine(rows: int) -> float:  # a step where a row costs little (1.3% of a one-row step)
    return 0.015 + 0.0002 * rows


def test_batch_rows_all_step_without_interactive_rows_or_before_the_cost_is_measured():
    assert br.stepping_background(0, 40, cpu) == 40
    assert br.stepping_background(2, 40, lambda _: 0.0) == 40


def test_batch_rows_step_as_far_as_the_allowance_reaches():
    assert br.STEP_ALLOWANCE == 0.03
    # one interactive row: 16 ms; 3% more allows 0.48 ms: a row (1 ms) does not fit
    assert br.stepping_background(1, 40, cpu) == 0
    assert br.stepping_background(1, 40, gpu) == 40
    assert br.stepping_background(1, 40, fine) == 2  # 15.2 ms * 1.03 = 15.66 ms: two more rows (15.6 ms)
    assert br.stepping_background(20, 40, cpu) == 1  # 35 ms * 1.03 = 36.05 ms: one more row
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
    assert len(s.hold) == 30 and s.start_rows == 0
    f = br.share(running, left, set(), NOW, total_rows=64, step_s=fine, interval_s=0.02)
    assert len(f.hold) == 28 and "b0" not in f.hold and "b1" not in f.hold  # the earliest deadlines step
    assert f.start_rows == 0
    # on a GPU every batch row steps beside it, and more may start
    g = br.share(running, left, set(), NOW, total_rows=64, step_s=gpu, interval_s=0.02)
    assert g.hold == frozenset() and g.start_rows == 64 - 4 - 30


def test_rows_already_stepping_keep_stepping():
    running = [job("i0", 0)] + [job(f"b{i}", 1, NOW + 3600 + i) for i in range(5)]
    held = {"b0", "b1", "b2", "b3"}  # b4 was stepping
    s = br.share(running, {}, held, NOW, total_rows=64, step_s=fine, interval_s=0.02)
    assert "b4" not in s.hold and len(s.hold) == 3  # it keeps its place; the earliest deadline takes the other
    assert s.hold == frozenset({"b1", "b2", "b3"})


def test_a_batch_row_near_its_deadline_steps_anyway():
    # 100 tokens left at 20 ms: 2 s of work, 4 s with the margin, and its deadline is 3 s away
    running = [job("i0", 0), job("late", 1, NOW + 3.0)] + [job(f"b{i}", 1) for i in range(5)]
    left = {"late": 100}
    s = br.share(running, left, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert "late" not in s.hold and len(s.hold) == 5  # though the allowance admits none
    s = br.share(running, left, set(), NOW, total_rows=64, step_s=fine, interval_s=0.02)
    assert "late" not in s.hold and len(s.hold) == 4  # where it admits two, it takes one of them


def test_free_stepping_places_let_batch_work_start():
    running = [job(f"i{i}", 0) for i in range(20)]
    s = br.share(running, {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert s.hold == frozenset() and s.start_rows == 1


def test_a_rounds_batch_prefill_costs_about_a_decode_step():
    # 40 ms a step; prefill 5 ms fixed + 0.25 ms a token: 140 tokens
    assert br.prefill_tokens(0.040, (0.005, 0.00025)) == 140
    assert br.prefill_tokens(0.004, (0.005, 0.00025)) == br.MIN_PREFILL_TOKENS
    assert br.prefill_tokens(0.0, (0.005, 0.00025)) is None and br.prefill_tokens(0.04, (0.0, 0.0)) is None
    s = br.share([job("b0", 1)], {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02,
                 prefill=(0.005, 0.00025))
    assert s.prefill_tokens == int((cpu(1) - 0.005) / 0.00025)


def test_right_after_interactive_rows_batch_rows_alone_keep_steps_short():
    # interactive rows ran 1 s ago: batch rows step within 2 one-row steps (32 ms: 17 rows), the rest sit out,
    # none start, and a round's prefill is sized by the shorter step
    running = [job(f"b{i}", 1, NOW + 3600 + i) for i in range(30)]
    s = br.share(running, {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02, foreground_at=NOW - 1.0,
                 prefill=(0.005, 0.00025))
    assert len(s.hold) == 13 and all(f"b{i}" not in s.hold for i in range(17)) and s.start_rows == 0
    assert s.prefill_tokens == int((cpu(17) - 0.005) / 0.00025)
    later = br.share(running, {}, set(), NOW, total_rows=64, step_s=cpu, interval_s=0.02,
                     foreground_at=NOW - br.LINGER_S - 0.1)
    assert later.hold == frozenset() and later.start_rows == 64 - 4 - 30  # the run of interactive work is over
    g = br.share(running, {}, set(), NOW, total_rows=64, step_s=gpu, interval_s=0.02, foreground_at=NOW - 1.0)
    assert g.hold == frozenset()  # on a GPU all step anyway


def test_sharing_remembers_the_rows_held_and_when_interactive_rows_ran():
    sharing = br.Sharing()
    batch = [job(f"b{i}", 1, NOW + 3600 + i) for i in range(30)]
    first = sharing.next([job("i0", 0), *batch], {}, NOW, total_rows=64, step_s=cpu, interval_s=0.02)
    assert sharing.foreground_at == NOW and sharing.held == first.hold and len(first.hold) == 30
    after = sharing.next(batch, {}, NOW + 0.5, total_rows=64, step_s=cpu, interval_s=0.02)
    assert len(after.hold) == 13 and sharing.held == after.hold and sharing.foreground_at == NOW
    assert sharing.next(batch, {}, NOW + 3.0, total_rows=64, step_s=cpu, interval_s=0.02).hold == frozenset()
