"""gpu_worker.robust_line: the line the fused chunks are sized by, through noise a least-squares fit bends to."""

from __future__ import annotations

import random

from gpu_worker.robust_line import MIN_PAIRS, theil_sen


def test_an_exact_line_is_read_exactly():
    line = theil_sen([(n, 0.004 + 0.000005 * n) for n in (4, 8, 16, 32, 64)], 0.25)
    assert line is not None
    assert abs(line.intercept - 0.004) < 1e-12 and abs(line.slope - 0.000005) < 1e-12
    assert line.slope_low > 0  # every pair agrees


def test_a_few_slow_steps_do_not_bend_it():
    points = [(n, 0.005 + 0.0007 * n) for n in (4, 6, 8, 10, 12, 14, 16, 20)]
    points[2] = (8, 0.05)  # a step three times as slow, and more
    points[5] = (14, 0.002)  # and one read low
    line = theil_sen(points, 0.25)
    assert line is not None
    assert abs(line.slope - 0.0007) < 0.0001 and abs(line.intercept - 0.005) < 0.001


def test_sizes_too_alike_draw_no_line():
    assert theil_sen([(300, 0.0055), (296, 0.0054), (310, 0.0056), (290, 0.0052)], 0.25) is None
    assert theil_sen([(4, 0.004), (8, 0.0041)], 0.25) is None  # one pair: fewer than MIN_PAIRS
    assert MIN_PAIRS == 3
    assert theil_sen([(0, 0.0), (0, 0.001), (0, 0.002)], 0.25) is None  # no size at all: no pair, no division


def test_noise_over_a_few_tokens_shows_as_a_slope_the_pairs_disagree_on():
    """An H100's chunks of 4-16 tokens: ~5 us a token under a millisecond of noise. Whatever the median slope reads,
    its lower quartile falls under zero, which is how the sizing knows not to trust it."""
    for seed in range(5):
        rng = random.Random(seed)
        points = [(n, 0.004 + 0.000005 * n + rng.gauss(0.0, 0.001)) for n in (4, 8, 16) * 5]
        line = theil_sen(points, 0.25)
        assert line is not None and line.slope_low < 0


def test_the_slopes_spread_is_their_lower_quartile():
    # pairs' slopes: 1, 2, 3 from (1, 0); 3, 4 from (2, 1); 5 from (3, 4): median 3, lower quartile 2
    line = theil_sen([(1, 0.0), (2, 1.0), (3, 4.0), (4, 9.0)], 0.0)
    assert line is not None and line.slope == 3.0 and line.slope_low == 2.0
    assert line.intercept == 0.0  # the median of y - 3x (-3, -5, -5, -3) is -4, and a cost is never negative


def test_costs_never_read_negative():
    line = theil_sen([(4, 0.010), (8, 0.006), (16, 0.002)], 0.25)  # cheaper with more tokens: noise
    assert line is not None and line.slope == 0.0 and line.intercept > 0
