"""A straight line through noisy measurements that a few outliers cannot bend: Theil and Sen's estimator. Pure.

A fused chunk's cost is measured as its step's time less a bare step's, so every sample carries a whole step's
noise, often larger than the tokens' own cost. A least-squares fit over such samples read an H100's ~5 us a token
as hundreds (a 4- and an 8-token chunk a millisecond apart are 250 us a token) and forgot it slowly; the median of
the slopes between pairs of samples, then the median of what the slope leaves, ignores up to ~29% of outliers, and
the spread of those slopes says whether a slope is there at all.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

MIN_PAIRS = 3  # pairs of samples whose x differ enough, before a slope is read


@dataclass(frozen=True, slots=True)
class Line:
    intercept: float  # >= 0
    slope: float  # the median of the pairs' slopes, >= 0
    slope_low: float  # their lower quartile: at or under zero, the noise hides any slope there is


def theil_sen(points: Iterable[tuple[float, float]], min_spread: float) -> Line | None:
    """The line y ~ intercept + slope * x through `points` (x > 0): the median slope of the pairs whose x differ by
    at least `min_spread` of the larger (closer pairs are noise over a small difference), then the median of
    y - slope * x; neither below zero (costs). None until MIN_PAIRS such pairs exist."""
    pts = list(points)
    slopes = sorted((y2 - y1) / (x2 - x1)
                    for i, (x1, y1) in enumerate(pts) for x2, y2 in pts[i + 1:]
                    if x1 != x2 and abs(x2 - x1) >= min_spread * max(x1, x2))
    if len(slopes) < MIN_PAIRS:
        return None
    slope = max(0.0, statistics.median(slopes))
    return Line(max(0.0, statistics.median(y - slope * x for x, y in pts)), slope, slopes[(len(slopes) - 1) // 4])
