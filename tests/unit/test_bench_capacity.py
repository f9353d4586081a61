"""The benchmarks' sustained-capacity probe (scripts/benchlib.saturate): a window in which nothing finished is a
clear error, not a capacity of 0 that fails later as a division by zero in the offered rate."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import benchlib as bl


def test_a_capacity_window_in_which_nothing_finished_is_a_clear_error():
    jobs = itertools.cycle([bl.Job(0, "short", [5] * 8, 4, timeout_s=60)])
    with pytest.raises(SystemExit, match=r"no request finished within the 0\.05 s measured"):  # nothing listens there
        asyncio.run(bl.saturate("http://127.0.0.1:1", jobs, concurrency=1, warm_s=0, measure_s=0.05))
