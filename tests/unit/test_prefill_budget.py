"""The per-step prefill bounds (pure): a lone engine, a background engine, and a chunk fused into a decode step."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gpu_worker.job import Job
from gpu_worker.lane_queue import LanePolicy
from gpu_worker.prefill_budget import (
    BACKGROUND_CHUNK_TOKENS,
    BACKGROUND_IDLE_CHUNK_TOKENS,
    FUSED_MIN_CHUNK,
    fused_chunk,
    step_budget,
)
from gpu_worker.robust_line import Line
from gpu_worker.scheduler import BatchLimits, Scheduler


@pytest.mark.parametrize(("chunk", "decoding", "background", "yielding", "want"), [
    (512, 3, False, False, 512),  # rows decode: the configured chunk
    (512, 0, False, False, None),  # nothing decodes: no bound
    (512, 0, True, False, BACKGROUND_IDLE_CHUNK_TOKENS),  # a background engine in a lull
    (512, 0, True, True, BACKGROUND_CHUNK_TOKENS),  # beside a busy foreground engine
    (32, 3, True, True, 32),  # never above the configured chunk
    (None, 3, True, True, None),  # chunked prefill off
    (0, 3, False, False, None),
])
def test_step_budget(chunk, decoding, background, yielding, want):
    assert step_budget(chunk, decoding, background=background, yielding=yielding) == want


def fc(**kw):
    """A fused chunk's size where the line through the recent chunks is (`fixed_s`, `per_token_s`), and the last
    chunk (64 tokens) cost what the line says unless `recent` is given."""
    fixed_s, per_token_s = kw.pop("fixed_s", 0.0), kw.pop("per_token_s", 0.001)
    args = dict(protect=True, line=Line(fixed_s, per_token_s, per_token_s), recent=[(64, fixed_s + 64 * per_token_s)],
                bare_step_s=0.04, interval_s=0.05, chunk_left=2000, deadline_left_s=None, new_tokens=8, previous=1000)
    args.update(kw)
    return fused_chunk(512, **args)


def test_a_fused_chunk_adds_under_one_bare_step():
    assert fc() == 20  # half of a 40 ms step at 1 ms a fused token
    assert fc(bare_step_s=0.2) == 100
    assert fc(bare_step_s=5.0) == 512  # never above the configured chunk
    assert fc(bare_step_s=0.001) == FUSED_MIN_CHUNK  # nor below the minimum
    assert fc(recent=[]) == FUSED_MIN_CHUNK  # nothing measured yet: the minimum
    assert fc(bare_step_s=0.0) == FUSED_MIN_CHUNK


def test_a_fused_chunks_fixed_part_is_paid_once_a_step():
    assert fc(fixed_s=0.01, per_token_s=0.0005) == 20  # 10 ms of the 20 ms share left, at 0.5 ms a token
    # an H100: ~4 ms a fused step whatever its chunk, ~5 us a token, against a 6 ms decode step. The fixed part alone
    # is over the share (3 ms): the fewest such steps are chunks whose tokens add half the share on top
    assert fc(fixed_s=0.004, per_token_s=0.000005, bare_step_s=0.006) == 300
    assert fc(fixed_s=0.004, per_token_s=0.00002, bare_step_s=0.006) == 75
    assert fc(fixed_s=0.004, per_token_s=0.0) == 512  # no cost per token to be seen


def test_tokens_that_overran_halve_the_next_chunk():
    cpu = dict(fixed_s=0.005, per_token_s=0.0005, previous=16)  # a 40 ms step: a 20 ms share, 15 ms of room
    assert fc(**cpu, recent=[(16, 0.012), (16, 0.013)]) == 30  # within the share: the line's 15 ms at 0.5 ms
    # twice past the fixed part and a share (the tokens' floor alone would say 11)
    assert fc(**cpu, recent=[(16, 0.026), (16, 0.027)]) == 8
    assert fc(**cpu, recent=[(16, 0.010), (16, 0.045)]) == 8  # once, but past a whole step: the rows' gap passed 2x
    assert fc(**cpu, recent=[(16, 0.010), (16, 0.026)]) == 18  # once, within 2x: read as a dearer token, not halved
    # an H100 (fixed ~4 ms over the 3 ms share): twice past the fixed part and a share halves it too
    gpu = dict(fixed_s=0.004, per_token_s=0.000005, bare_step_s=0.006, previous=64)
    assert fc(**gpu, recent=[(64, 0.0043), (64, 0.0044)]) == 128  # the tokens added ~0.4 ms: grow
    assert fc(**gpu, recent=[(64, 0.008), (64, 0.0075)]) <= 32


def test_below_the_share_a_token_never_costs_less_than_the_recent_chunks_did():
    # the line's slope reads 0.1 ms a token (noise), the last 16-token chunk's tokens cost 0.5 ms each
    assert fc(fixed_s=0.005, per_token_s=0.0001, recent=[(16, 0.013)]) == 30  # 15 ms of room at 0.5 ms
    assert fc(fixed_s=0.005, per_token_s=0.0, recent=[(16, 0.013)]) == 30  # no slope at all: the same
    # the median of the last chunks, so one hiccup among them does not pin the chunks down
    assert fc(fixed_s=0.005, per_token_s=0.0, recent=[(16, 0.013), (16, 0.06), (16, 0.013)]) == 30


def test_the_room_for_tokens_shrinks_smoothly_as_the_fixed_part_grows():
    """However large the fixed part, tokens keep half of the share (review of an H100 run: noise moved the fixed part
    across the share, the room left jumped between none and all of it, and the chunks shrank to a handful)."""
    gpu = dict(per_token_s=0.000005, bare_step_s=0.006)
    sizes = [fc(**gpu, fixed_s=f, recent=[(64, f + 64 * 0.000005)]) for f in (0.0, 0.001, 0.0015, 0.00299, 0.003,
                                                                                 0.0035, 0.0055)]
    assert sizes == [512, 400, 300, 300, 300, 300, 300]


def test_costs_not_yet_separable_double_the_chunk_to_find_out():
    assert fc(line=None, previous=6) == 12
    assert fc(line=None, previous=0) == FUSED_MIN_CHUNK
    assert fc(line=None, previous=400) == 512


def test_at_the_minimum_a_slope_the_noise_hides_does_not_hold_the_chunks_there():
    """A millisecond of noise over a few tokens reads as a dear token: the chunks would stay at the minimum (review of
    the H100's costs in simulation: 4-token chunks for tens of steps)."""
    noisy = Line(0.004, 0.0003, -0.0001)  # 300 us a token at the median of the pairs, but a quarter of them fall
    recent = [(4, 0.0052), (4, 0.0041)]
    gpu = dict(bare_step_s=0.006, recent=recent)
    assert fc(**gpu, line=noisy, previous=FUSED_MIN_CHUNK) == 2 * FUSED_MIN_CHUNK
    assert fc(**gpu, line=noisy, previous=16) == 5  # above the minimum the line sizes it (1.5 ms at 300 us)
    told = Line(0.004, 0.0003, 0.0002)  # a slope the pairs agree on holds it
    assert fc(**gpu, line=told, previous=FUSED_MIN_CHUNK) == 5  # 1.5 ms of room at 300 us a token


def test_a_fused_chunk_grows_at_most_twofold_from_the_last():
    assert fc(previous=0) == FUSED_MIN_CHUNK  # the first: the minimum, whatever the estimate says
    assert fc(previous=6) == 12
    assert fc(previous=6, per_token_s=0.01) == FUSED_MIN_CHUNK  # shrinking is never held back
    assert fc(previous=6, deadline_left_s=3.0) == 100  # a deadline that needs more gets it at once


def test_no_interactive_row_to_protect_means_the_largest_chunk():
    assert fc(protect=False) == 512


def test_a_tight_deadline_makes_the_chunks_bigger():
    # 2,000 prompt tokens to go; each fused step ~2 bare steps (80 ms) x 1.5 margin = 120 ms
    assert fc(deadline_left_s=3600.0) == 20  # plenty of time: the gap-bounded size
    # 10 s left, 8 new tokens at 50 ms (x 1.5) -> 9.4 s for the prompt -> 78 steps -> 26 tokens a step
    assert fc(deadline_left_s=10.0) == 26
    # 3 s left -> 2.4 s -> 20 steps -> 100 tokens a step
    assert fc(deadline_left_s=3.0) == 100
    assert fc(deadline_left_s=0.5) == 512  # not even one step's time: as fast as allowed
    assert fc(deadline_left_s=3.0, chunk_left=0) == 20  # nothing left to prefill


def test_the_scheduler_sizes_a_fused_chunk_from_its_measured_costs():
    s = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 4096), chunk_tokens=512, fused=True)
    for _ in range(10):
        for tokens in (16, 32, 64):
            s.tracker.observe_fused(tokens, tokens * 0.001)  # a fused token adds 1 ms
        s.tracker.observe_bare_step(2, 0.025)
    s.started([Job(id=f"r{i}", lane="short", rank=0, deadline=1e9, arrived=0.0, tokens=10, prompt_tokens=5,
                   new_tokens=100) for i in range(2)])
    sizes = [s.plan(1.0, free_rows=4, chunking=True, chunk_left=1000).chunk_tokens for _ in range(4)]
    # up from the minimum to half of a 25 ms step at 1 ms a token: 12.5, read as 11 since the last chunks' sizes are
    # spread (16 to 64) and their median cost over their mean size is 1.09 ms a token
    assert sizes == [FUSED_MIN_CHUNK, 8, 11, 11]
    for _ in range(20):
        s.tracker.observe_bare_step(2, 0.05)
    assert all(s.plan(1.0, free_rows=4, chunking=True, chunk_left=1000).chunk_tokens > 12 for _ in range(2))  # slower
    unfused = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 4096), chunk_tokens=512)
    unfused.started([Job(id=f"r{i}", lane="short", rank=0, deadline=1e9, arrived=0.0, tokens=10, prompt_tokens=5)
                     for i in range(2)])
    assert unfused.plan(1.0, free_rows=4, chunking=True, chunk_left=1000).chunk_tokens == 512


def run_fused(fixed_s: float, per_token_s: float, bare_s: float, steps: int,
              noise: Callable[[], float] = lambda: 1.0, *, whole_step: bool = False) -> list[int]:
    """The sizes a scheduler picks step after step for a long prompt beside two interactive rows, each fused step
    adding `fixed_s` plus `per_token_s` a token to a `bare_s` decode step, measured through `noise()`: on what the
    chunk adds, or (`whole_step`) on the whole step as the worker measures it (a fused step's time less the bare
    steps' fit, itself learned through the noise, so the bare step's noise lands on the chunk's cost)."""
    s = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 4096), chunk_tokens=512, fused=True)
    s.started([Job(id=f"r{i}", lane="short", rank=0, deadline=1e9, arrived=0.0, tokens=10, prompt_tokens=5,
                   new_tokens=100) for i in range(2)])
    for _ in range(40 if whole_step else 10):
        s.tracker.observe_bare_step(2, bare_s * (noise() if whole_step else 1.0))
    sizes = []
    for _ in range(steps):
        size = s.plan(1.0, free_rows=4, chunking=True, chunk_left=100_000).chunk_tokens
        added = (fixed_s + per_token_s * size) * noise()
        s.tracker.observe_fused(size, added + (bare_s * noise() - s.tracker.bare.predict(2) if whole_step else 0.0))
        sizes.append(size)
    return sizes


def test_a_gpus_fixed_fused_cost_does_not_pin_the_chunks_to_the_minimum():
    """As measured on an H100 (fixed ~4 ms, ~5 us a token, 6 ms decode steps): the chunks reach ~300 tokens (half the
    share's 1.5 ms at 5 us) within a few steps, a gap of 1.92x a step. Read as a cost per token through zero, the
    4-token chunk's 1 ms a token kept them at 4."""
    sizes = run_fused(0.004, 0.000005, 0.006, 40)
    assert sizes[:8] == [4, 8, 16, 32, 64, 128, 256, 300]  # doubling until the line says how far
    assert all(256 <= n <= 300 for n in sizes[8:] if n != 224)
    # sizes too alike to tell the parts apart (all within a quarter of each other) step a quarter down, once, to find
    # out: never up, where a chunk could cost the rows more than the share
    assert 1 <= sizes.count(224) <= 2 and max(sizes) == 300


def test_a_cpus_per_token_cost_keeps_the_chunks_small():
    """A small CPU (fixed ~5 ms, 0.7 ms a token, 21 ms decode steps): after finding the two parts, the chunks add
    about the share (10.5 ms: 7 tokens), and every chunk keeps the rows' gap under twice a step."""
    sizes = run_fused(0.005, 0.0007, 0.021, 200)
    assert max(sizes) <= 16 and all(0.005 + 0.0007 * n < 0.021 for n in sizes)
    assert max(sizes[3:]) == 7  # after the first chunks (4, 8, 16), never above the share's 7 tokens
    assert sorted(sizes)[len(sizes) // 2] == 7  # the median chunk: (10.5 - 5) / 0.7


def test_a_noisy_cpu_does_not_grow_the_chunks_past_the_rows_gap():
    """The same CPU measured through noise (+-30% lognormal, and one step in twenty three times as slow): noise reads
    the fixed part high and the slope low, which alone would size chunks by the slope and double them toward ~100
    tokens (review: 52-96 tokens, a gap over 2x a step in 3-13% of steps). A token is never read cheaper than the last
    chunks' tokens cost, and a chunk that passed 2x, or two that passed the share, halve the next."""
    rng = random.Random(7)

    def noise() -> float:
        return rng.lognormvariate(0.0, 0.3) * (3.0 if rng.random() < 0.05 else 1.0)

    for _ in range(5):
        sizes = run_fused(0.005, 0.0007, 0.021, 300, noise)
        over = [n for n in sizes if 0.005 + 0.0007 * n > 0.021]  # the chunk's true cost past a whole bare step
        assert len(over) <= 0.01 * len(sizes), sorted(over)
        assert sorted(sizes)[int(0.95 * len(sizes))] <= 16


def steps_to_prefill(sizes: list[int], tokens: int = 2048) -> int:
    return next(i + 1 for i in range(len(sizes)) if sum(sizes[:i + 1]) >= tokens)


def test_a_noisy_gpu_still_prefills_a_long_prompt_in_large_chunks():
    """The H100's costs (fixed ~4 ms a fused step, ~5 us a token, 6 ms decode steps) with noise on the chunk's cost:
    a slow step halves the chunk, but the chunks grow back, and a 2,048-token prompt still goes in tens of steps
    (15-35 in these runs), not the hundreds that 4- to 16-token chunks would take. The chunks hover around 70-160
    tokens (the median of each run): well under the ~300 that fit without noise, since the cost per token is never
    read under what the last few chunks' tokens cost, which this noise reads dear."""
    rng = random.Random(7)

    def noise() -> float:
        return rng.lognormvariate(0.0, 0.3) * (3.0 if rng.random() < 0.05 else 1.0)

    for _ in range(5):
        sizes = run_fused(0.004, 0.000005, 0.006, 200, noise)
        assert steps_to_prefill(sizes) <= 50, sizes[:60]
        assert sorted(sizes)[len(sizes) // 2] >= 64


def test_a_gpus_long_prompt_is_not_slowed_by_the_decode_steps_own_noise():
    """As the worker measures it, a fused chunk's cost carries the whole step's noise (+-10% of a 6 ms step, one step
    in twenty 3x as slow: more than half a millisecond, against ~5 us a token). Sized by a least-squares fit, the
    fixed part read low and the first small chunks' noise read as hundreds of us a token kept the chunks at 4-30
    tokens: 46 fused steps at the median of these runs and up to 161 (an H100 took 361-1,395 ms for the prompt's
    first token, against 59 ms in chunks of their own). Through a line the noise cannot bend, with tokens keeping half
    the share whatever the fixed part, it takes 11-39 here."""
    rng = random.Random(3)

    def noise() -> float:
        return rng.lognormvariate(0.0, 0.1) * (3.0 if rng.random() < 0.05 else 1.0)

    steps = sorted(steps_to_prefill(run_fused(0.004, 0.000005, 0.006, 300, noise, whole_step=True)) for _ in range(20))
    assert steps[10] <= 25 and steps[-1] <= 60, steps
