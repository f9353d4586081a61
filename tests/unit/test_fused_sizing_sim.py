"""scripts/fused_sizing.py: the fused chunk sizing simulated against measured cost models. What it reports must
follow from the sizes the worker's scheduler picks, or a rule change could not be judged by it."""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import fused_sizing as fs


def args(**kw) -> argparse.Namespace:
    base = dict(seeds=5, sigma=0.3, hiccups=0.05, noise_on="step")
    base.update(kw)
    return argparse.Namespace(**base)


def test_without_noise_the_chunks_are_the_unit_tests_and_the_prompt_goes_in_whole():
    sizes = fs.run("h100", 0, sigma=0.0, hiccups=0.0, on_step=True)
    assert sum(sizes) == fs.PROMPT
    # doubling until the line through the chunks says how far: ~325 tokens add half the 3.25 ms share at 5 us
    assert sizes[:8] == [4, 8, 16, 32, 64, 128, 256, 325]
    cpu = fs.run("cpu", 0, sigma=0.0, hiccups=0.0, on_step=False)
    assert sum(cpu) == fs.PROMPT and statistics.median(cpu) == 7


def test_figures_follow_from_the_sizes():
    r = fs.regime_figures("h100", args(seeds=1, sigma=0.0, hiccups=0.0))
    sizes = fs.run("h100", 0, sigma=0.0, hiccups=0.0, on_step=True)
    assert r["steps_median"] == r["steps_max"] == len(sizes)
    fixed, per_token, bare = fs.REGIMES["h100"]
    assert abs(r["ttft_ms_median"] - sum(bare + fixed + per_token * n for n in sizes) * 1000) < 1e-9
    assert r["worst_true_gap_x"] == (bare + fixed + per_token * max(sizes)) / bare
    assert r["chunk_median"] == statistics.median(sizes)
    assert r["over_2x_share_mean"] == 0.0  # 325 tokens: 1.87x a step



def test_a_chunk_past_2x_is_counted(monkeypatch):
    monkeypatch.setitem(fs.REGIMES, "dear", (0.0, 0.002, 0.006))  # 2 ms a token on a 6 ms step: 4 tokens are 2.3x
    r = fs.regime_figures("dear", args(seeds=1, sigma=0.0, hiccups=0.0))
    sizes = fs.run("dear", 0, sigma=0.0, hiccups=0.0, on_step=True)
    assert r["over_2x_share_mean"] == sum(0.006 + 0.002 * n > 0.012 for n in sizes) / len(sizes) > 0.5
