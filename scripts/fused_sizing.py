"""The fused chunk sizing in simulation: the worker's own scheduler sizes the chunks of a 2,048-token prompt fused
into the decode steps of two interactive rows, against a cost model (a bare decode step; a fused chunk adds a fixed
part plus a cost per token) measured through noise, with no model and no clock. Each regime is run over --seeds
seeds; the figures are the steps the prompt took (its first token's wait, in steps, and in the model's time), the
median chunk, and the share of fused steps whose true cost (the model's, without noise) put the rows' gap over 2x
a bare step.

Noise is lognormal (--sigma) with one step in 1/--hiccups three times as slow, applied either to the whole step
(`--noise-on step`, as a real machine measures: a fused chunk's cost is its step's time less a bare step's, so it
carries the whole step's noise) or to the chunk's own cost only (`--noise-on extra`, as the unit tests model it).
With the first, the sizing before `gpu_worker.robust_line` reproduced the slow first token measured on an H100
(docs/bench/long-prefill-h100.json: 361-1,395 ms, ~35-130 fused steps of ~10 ms), which the second did not.

    python scripts/fused_sizing.py
    python scripts/fused_sizing.py --noise-on extra --json /tmp/fused.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_worker.job import Job
from gpu_worker.lane_queue import LanePolicy
from gpu_worker.scheduler import BatchLimits, Scheduler

PROMPT = 2048
CHUNK_TOKENS = 512
# (fixed s, s a token, bare decode step s) of a fused chunk
REGIMES = {
    "h100": (0.004, 0.000005, 0.0065),  # measured: the tiny bench model on an H100 (stop 40)
    "cpu": (0.005, 0.0007, 0.021),  # measured: the same model on this 2-core CPU
    "gpu-large": (0.002, 0.00002, 0.008),  # assumed: a real-size model on a GPU, not measured
}


def run(regime: str, seed: int, *, sigma: float, hiccups: float, on_step: bool) -> list[int]:
    """The chunk sizes the scheduler picks, step by step, until the prompt is in."""
    fixed, per_token, bare = REGIMES[regime]
    rng = random.Random(seed)

    def noise() -> float:
        return rng.lognormvariate(0.0, sigma) * (3.0 if rng.random() < hiccups else 1.0)

    s = Scheduler([LanePolicy("short", 0.0)], BatchLimits(8, 4096), chunk_tokens=CHUNK_TOKENS, fused=True)
    s.started([Job(id=f"r{i}", lane="short", rank=0, deadline=1e9, arrived=0.0, tokens=10, prompt_tokens=5,
                   new_tokens=100) for i in range(2)])
    for _ in range(40):
        s.tracker.observe_bare_step(2, bare * (noise() if on_step else 1.0))
    sizes: list[int] = []
    while (left := PROMPT - sum(sizes)) > 0 and len(sizes) < 10 * PROMPT:
        size = min(left, s.plan(1.0, free_rows=4, chunking=True, chunk_left=left).chunk_tokens or 0)
        if on_step:
            extra = bare * noise() + (fixed + per_token * size) * noise() - s.tracker.bare.predict(2)
        else:
            extra = (fixed + per_token * size) * noise()
        s.tracker.observe_fused(size, extra)
        sizes.append(size)
    return sizes


def regime_figures(regime: str, args: argparse.Namespace) -> dict[str, Any]:
    fixed, per_token, bare = REGIMES[regime]
    steps, ttft, medians, over, worst = [], [], [], [], []
    for seed in range(args.seeds):
        sizes = run(regime, seed, sigma=args.sigma, hiccups=args.hiccups, on_step=args.noise_on == "step")
        gaps = [(bare + fixed + per_token * n) / bare for n in sizes]
        steps.append(len(sizes))
        ttft.append(sum(bare + fixed + per_token * n for n in sizes) * 1000)
        medians.append(statistics.median(sizes))
        over.append(sum(g > 2.0 for g in gaps) / len(gaps))
        worst.append(max(gaps))
    return {"steps_median": statistics.median(steps), "steps_max": max(steps),
            "ttft_ms_median": statistics.median(ttft),
            "chunk_median": statistics.median(medians), "over_2x_share_mean": statistics.mean(over),
            "worst_true_gap_x": max(worst)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--sigma", type=float, default=0.3)
    ap.add_argument("--hiccups", type=float, default=0.05)
    ap.add_argument("--noise-on", choices=("step", "extra"), default="step")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    report: dict[str, Any] = {"config": vars(args), "regimes": {}}
    print(f"{'regime':<11}{'steps med':>10}{'max':>6}{'~TTFT ms':>10}{'chunk med':>10}{'over 2x':>9}{'worst x':>9}")
    for regime in args.regimes.split(","):
        r = report["regimes"][regime] = regime_figures(regime, args)
        print(f"{regime:<11}{r['steps_median']:>10.0f}{r['steps_max']:>6}{r['ttft_ms_median']:>10.0f}"
              f"{r['chunk_median']:>10.0f}{r['over_2x_share_mean']:>9.3f}{r['worst_true_gap_x']:>9.2f}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
