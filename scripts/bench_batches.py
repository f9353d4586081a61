"""Batch API benchmark: a large batch on a live deployment, on the whole stack (gateway over HTTP, Redis, one
worker with the engine benchmark's model, one batch runner), in one run:

- idle capacity: closed-loop clients submitting the batch's own kind of request, back to back;
- the batch alone: a file of --items requests (prompts 64-256 tokens, outputs 32-128) through
  `POST /v1/files` and `POST /v1/batches`; its items per second from `in_progress_at` to `completed_at`, as a
  share of the idle capacity (goal: `batch_share_of_idle_capacity` >= 0.8);
- interactive short requests (prompt <= 64, output <= 32; Poisson at --interactive-rps) alone, then the same
  arrivals while a large batch runs: their p99 latency with the batch over without it (goal:
  `interactive_p99_ratio` <= 1.2; "without" is measured before and after, and the larger taken).

    python scripts/bench_batches.py --json docs/bench/batches.json    (300 items, 1.5 req/s for 180 s a phase)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import sys
import time
from typing import Any

import benchlib as bl
import httpx

NATIVE = f"/v1/models/{bl.MODEL}/requests"


def batch_file(n: int, seed: int) -> bytes:
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        body = {"input": {"input_ids": [rng.randrange(3, 8192) for _ in range(rng.randint(64, 256))]},
                "params": {"max_new_tokens": rng.randint(32, 128), "ignore_eos": True}}
        lines.append(json.dumps({"custom_id": f"item-{i}", "method": "POST", "url": NATIVE, "body": body}))
    return ("\n".join(lines) + "\n").encode()


def batch_jobs(n: int, seed: int) -> list[bl.Job]:
    """The batch's kind of request, as closed-loop clients submit it (no deadline pressure, as a batch has
    none within its window)."""
    rng = random.Random(seed)
    jobs = [bl.Job(i, "long", [rng.randrange(3, 8192) for _ in range(rng.randint(64, 256))], rng.randint(32, 128))
            for i in range(n)]
    for j in jobs:
        j.timeout_s = 600
    return jobs


def interactive(n: int, rate: float, seed: int) -> list[bl.Job]:
    jobs = bl.mix(n, seed, long=False)
    bl.poisson(jobs, rate, seed)
    for j in jobs:
        j.timeout_s = 120
    return jobs


def start_batch(url: str, n: int, seed: int) -> str:
    with httpx.Client(base_url=url, timeout=120) as c:
        f = c.post("/v1/files", files={"file": ("batch.jsonl", batch_file(n, seed))}, data={"purpose": "batch"})
        f.raise_for_status()
        b = c.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": NATIVE,
                                        "completion_window": "24h"})
        b.raise_for_status()
        return str(b.json()["id"])


def batch(url: str, batch_id: str) -> dict[str, Any]:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()


def wait_batch(url: str, batch_id: str, progress: str) -> dict[str, Any]:
    last = 0.0
    while True:
        b = batch(url, batch_id)
        if b["status"] in ("completed", "failed", "expired", "cancelled"):
            return b
        if time.monotonic() - last > 10:
            c = b["request_counts"]
            print(f"  {progress}: {b['status']} {c['completed']}/{c['total']}", flush=True)
            last = time.monotonic()
        time.sleep(0.5)


def p99(url: str, jobs: list[bl.Job]) -> tuple[float | None, int]:
    outs, _ = asyncio.run(bl.drive(url, jobs))
    ok = [o.latency_ms for o in outs if o.status == "succeeded"]
    return bl.pct(ok, 0.99), len(ok)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", type=int, default=300, help="requests in the batch run alone")
    ap.add_argument("--interactive-rps", type=float, default=1.5)
    # 180 s at 1.5 req/s is 270 requests a phase: their p99 is the third-largest, not (as with 90) the largest
    ap.add_argument("--interactive-s", type=float, default=180.0, help="seconds of interactive arrivals per phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json")
    bl.add_capacity_args(ap, warm_s=10, measure_s=30)
    args = ap.parse_args()

    n_inter = max(1, int(args.interactive_rps * args.interactive_s))
    report: dict[str, Any] = {"config": vars(args)}
    with bl.stack(bl.model_config(lanes=True), args.redis_url, parts=("worker", "gateway", "batches")) as st:
        print("idle capacity (the batch's kind of request, closed loop)", flush=True)
        cap = asyncio.run(bl.saturate(st.url, itertools.cycle(batch_jobs(400, args.seed + 1)),
                                      concurrency=args.capacity_clients, warm_s=args.capacity_warm_s,
                                      measure_s=args.capacity_s, progress="idle "))
        print(f"  {cap:.2f} req/s", flush=True)
        if cap <= 0:  # every ratio below is to it
            sys.exit(f"no request finished in the {args.capacity_s:g} s idle-capacity window: the machine is too "
                     "busy for it, or give a longer --capacity-s")
        print(f"the batch alone: {args.items} items", flush=True)
        b = wait_batch(st.url, start_batch(st.url, args.items, args.seed), "batch alone")
        span = max(1e-9, b["completed_at"] - b["in_progress_at"])
        alone_rps = b["request_counts"]["completed"] / span
        print(f"  {alone_rps:.2f} items/s over {span:.0f} s ({b['status']})", flush=True)
        print(f"interactive alone: {n_inter} short requests at {args.interactive_rps} req/s", flush=True)
        before, n_before = p99(st.url, interactive(n_inter, args.interactive_rps, args.seed + 2))
        print("interactive while a batch runs", flush=True)
        # enough items to outlast the interactive phase at the batch's own pace
        big = start_batch(st.url, int(alone_rps * (args.interactive_s + 30) * 1.5) + 50, args.seed + 3)
        while batch(st.url, big)["status"] == "validating":
            time.sleep(0.2)
        time.sleep(5)  # the batch's items fill the rows first
        start_done = batch(st.url, big)["request_counts"]["completed"]
        t0 = time.monotonic()
        during, n_during = p99(st.url, interactive(n_inter, args.interactive_rps, args.seed + 2))
        during_rps = (batch(st.url, big)["request_counts"]["completed"] - start_done) / (time.monotonic() - t0)
        httpx.post(f"{st.url}/v1/batches/{big}/cancel", timeout=30)
        wait_batch(st.url, big, "cancelling")
        print("interactive alone, again", flush=True)
        after, n_after = p99(st.url, interactive(n_inter, args.interactive_rps, args.seed + 2))
    base = max(v for v in (before, after) if v is not None)
    report.update({
        "idle_capacity_rps": cap, "batch_rps_alone": alone_rps, "batch_share_of_idle_capacity": alone_rps / cap,
        "interactive_p99_ms_alone": {"before": before, "after": after, "n": [n_before, n_after]},
        "interactive_p99_ms_with_batch": during, "interactive_with_batch_n": n_during,
        "interactive_p99_ratio": (during / base) if during and base else None,
        "batch_rps_during_interactive": during_rps,
    })
    print(f"\nidle capacity {cap:.2f} req/s; the batch alone {alone_rps:.2f} items/s "
          f"= {report['batch_share_of_idle_capacity']:.2f} of it (goal >= 0.8)")
    print(f"interactive p99: alone {before:.0f} / {after:.0f} ms, with a batch running {during:.0f} ms "
          f"(ratio {report['interactive_p99_ratio']:.2f}; goal <= 1.2); the batch meanwhile {during_rps:.2f} items/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
