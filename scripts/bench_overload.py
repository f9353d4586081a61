"""Overload benchmark: offered load at 2x capacity for a fixed time, per-request timeouts of a few
seconds; deadline-aware scheduling (lanes, EDF, expiry without compute, admission control) vs FIFO
(deadlines ignored), the same stack otherwise.

Capacity is sustained throughput with no deadline pressure (benchlib.saturate: closed-loop clients
keeping a queue waiting for the rows, successes counted after a warm-up). Goodput = requests that
succeeded by their deadline, per second of offered load. Every request must end in a terminal state
or a 429 at submit.

    python scripts/bench_overload.py --duration 60 --json docs/bench/overload.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from pathlib import Path
from typing import Any

import benchlib as bl

TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


def workload(n: int, seed: int, timeout: float) -> list[bl.Job]:
    jobs = bl.mix(n, seed, long=False)  # short requests: prompt <= 64, output <= 32
    for j in jobs:
        j.timeout_s = timeout
    return jobs


def run(name: str, scheduling: str, args: argparse.Namespace, capacity: float | None) -> dict[str, Any]:
    cfg = bl.model_config(lanes=True, scheduling=scheduling, max_batch_tokens=args.max_batch_tokens)
    with bl.stack(cfg, args.redis_url) as st:
        asyncio.run(bl.drive(st.url, workload(8, 99, 60)))  # warm-up
        result: dict[str, Any] = {}
        if capacity is None:
            capacity = bl.sustained_capacity(st.url, workload(10_000, args.seed + 7, 600), args)
            result["capacity_rps"] = capacity
            print(f"capacity (sustained, {args.capacity_clients} clients back to back, no deadline pressure): "
                  f"{capacity:.2f} req/s", flush=True)
        rate = args.overload * capacity
        n = int(rate * args.duration)
        jobs = workload(n, args.seed, args.timeout)
        bl.poisson(jobs, rate, args.seed)
        coe0 = bl.scrape(st.worker_metrics, "batchgate_compute_on_expired_total")
        exp0 = bl.scrape(st.worker_metrics, "batchgate_expired_before_compute_total")
        t0 = time.perf_counter()
        outs, _ = asyncio.run(bl.drive(st.url, jobs, wait_s=args.timeout + 30))
        wall = time.perf_counter() - t0
        span = jobs[-1].at
        s = bl.summarise(outs, span)["classes"]["all"]
        statuses: dict[str, int] = {}
        reasons: dict[str, int] = {}
        for o in outs:
            key = "429" if o.http == 429 else o.status
            statuses[key] = statuses.get(key, 0) + 1
            if o.status == "expired":
                why = re.sub(r"\d+", "N", o.error.split(";")[0])[:60]  # one entry per kind, not per count
                reasons[why] = reasons.get(why, 0) + 1
        result.update({
            "offered_rps": rate, "offered": n, "duration_s": span, "wall_s": wall,
            "goodput_rps": s["goodput_rps"], "throughput_rps": s["throughput_rps"],
            "goodput_vs_capacity": s["goodput_rps"] / capacity,
            "succeeded": s["succeeded"], "in_deadline": s["in_deadline"],
            "succeeded_late": s["succeeded"] - s["in_deadline"],
            "expired": s["expired"], "rejected_429": s["rejected_429"], "statuses": statuses,
            "expired_reasons": reasons,
            "all_terminal_or_429": all(o.http == 429 or o.status in TERMINAL for o in outs),
            "compute_on_expired": bl.scrape(st.worker_metrics, "batchgate_compute_on_expired_total") - coe0,
            "expired_without_compute": bl.scrape(st.worker_metrics, "batchgate_expired_before_compute_total") - exp0,
            "latency_p50_ms": s["latency_p50_ms"], "latency_p99_ms": s["latency_p99_ms"],
        })
        print(f"{name}: offered {rate:.2f} req/s x {span:.0f} s = {n}; goodput {s['goodput_rps']:.2f} req/s "
              f"({result['goodput_vs_capacity']:.0%} of capacity), statuses {statuses}, "
              f"compute on expired {result['compute_on_expired']:.0f}; expired because: {reasons}", flush=True)
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--timeout", type=float, default=3.0, help="per-request timeout_s")
    bl.add_capacity_args(ap, warm_s=10.0, measure_s=30.0)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json")
    args = ap.parse_args()
    aware = run("deadline_aware", "deadline", args, None)
    capacity = aware.pop("capacity_rps")
    fifo = run("fifo", "fifo", args, capacity)
    report = {"capacity_rps": capacity, "overload": args.overload, "timeout_s": args.timeout,
              "deadline_aware": aware, "fifo": fifo, "compute_on_expired": aware["compute_on_expired"],
              "goodput_ratio_vs_fifo": aware["goodput_rps"] / fifo["goodput_rps"] if fifo["goodput_rps"] else None}
    print(f"\n{'':<16}{'goodput/s':>10}{'of cap':>8}{'ok late':>8}{'expired':>8}{'429':>6}{'wasted':>8}")
    for name in ("deadline_aware", "fifo"):
        r = report[name]
        print(f"{name:<16}{r['goodput_rps']:>10.2f}{r['goodput_vs_capacity']:>8.0%}{r['succeeded_late']:>8}"
              f"{r['expired']:>8}{r['rejected_429']:>6}{r['compute_on_expired']:>8.0f}")
    print(f"capacity {capacity:.2f} req/s; compute_on_expired (deadline-aware) {report['compute_on_expired']:.0f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
