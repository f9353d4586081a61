"""Overload benchmark: offered load at 2x capacity for a fixed time, per-request timeouts of a few
seconds; deadline-aware scheduling (lanes, EDF, expiry without compute, admission control) vs FIFO
(deadlines ignored), the same stack otherwise.

`--workload mixed` instead offers the mixed workload of real use (prompts 16-256 tokens, outputs 8-128, 60 s
timeouts) to the deadline-aware stack alone, in two phases: steady (--steady-load x capacity, under it) and
overload (--overload x capacity). Beside goodput it reports admission's two mistakes as shares of all
requests (`benchlib.misjudged`): refusals of requests that would have finished in time, and requests
accepted that then expired; and the measured finish against the gateway's estimate (`eta_ms`).

Capacity is sustained throughput with no deadline pressure (benchlib.saturate: closed-loop clients
keeping a queue waiting for the rows, successes counted after a warm-up). Goodput = requests that
succeeded by their deadline, per second of offered load. Every request must end in a terminal state
or a 429 at submit.

    python scripts/bench_overload.py --duration 60 --json docs/bench/overload.json
    python scripts/bench_overload.py --workload mixed --duration 60 --json docs/bench/overload-mixed.json
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


def workload(n: int, seed: int, timeout: float, kind: str = "short") -> list[bl.Job]:
    # short: prompt <= 64, output <= 32; mixed: prompt 16-256, output 8-128
    jobs = bl.mix(n, seed, long=False) if kind == "short" else bl.mixed(n, seed)
    for j in jobs:
        j.timeout_s = timeout
    return jobs


def phase(st: bl.Stack, name: str, rate: float, capacity: float, args: argparse.Namespace,
          seed: int) -> dict[str, Any]:
    """Offer `rate` req/s of the workload for --duration seconds; goodput, statuses and admission's mistakes."""
    n = int(rate * args.duration)
    jobs = workload(n, seed, args.timeout, args.workload)
    bl.poisson(jobs, rate, seed)
    coe0 = bl.scrape(st.worker_metrics, "batchgate_compute_on_expired_total")
    exp0 = bl.scrape(st.worker_metrics, "batchgate_expired_before_compute_total")
    t0 = time.perf_counter()
    outs, _ = asyncio.run(bl.drive(st.url, jobs, wait_s=args.timeout + 30, sync=args.workload == "short"))
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
    result: dict[str, Any] = {
        "offered_rps": rate, "offered": n, "duration_s": span, "wall_s": wall,
        "goodput_rps": s["goodput_rps"], "throughput_rps": s["throughput_rps"],
        "goodput_vs_capacity": s["goodput_rps"] / capacity,
        # over the whole time until every request ended: with deadlines as long as the phase (the mixed workload's
        # 60 s), work offered in it is still finishing, in time, for up to a deadline after it
        "goodput_over_wall_rps": s["in_deadline"] / wall,
        "goodput_over_wall_vs_capacity": s["in_deadline"] / wall / capacity,
        "succeeded": s["succeeded"], "in_deadline": s["in_deadline"],
        "succeeded_late": s["succeeded"] - s["in_deadline"],
        "expired": s["expired"], "rejected_429": s["rejected_429"], "statuses": statuses,
        "expired_reasons": reasons,
        "all_terminal_or_429": all(o.http == 429 or o.status in TERMINAL for o in outs),
        "compute_on_expired": bl.scrape(st.worker_metrics, "batchgate_compute_on_expired_total") - coe0,
        "expired_without_compute": bl.scrape(st.worker_metrics, "batchgate_expired_before_compute_total") - exp0,
        "latency_p50_ms": s["latency_p50_ms"], "latency_p99_ms": s["latency_p99_ms"],
        "admission": bl.misjudged(outs),
    }
    if args.outcomes:  # one line per request, for looking into admission's decisions afterwards
        with open(args.outcomes, "a") as f:
            for o in outs:
                f.write(json.dumps({"phase": name, "id": o.job.idx, "at_s": o.job.at, "prompt": len(o.job.prompt),
                                    "out": o.job.out, "http": o.http, "status": o.status, "error": o.error[:200],
                                    "submitted": o.submitted, "latency_ms": o.latency_ms if o.done else None,
                                    "eta_ms": o.eta_ms, "queue_ms": o.queue_ms, "in_deadline": o.in_deadline}) + "\n")
    adm = result["admission"]
    print(f"{name}: offered {rate:.2f} req/s x {span:.0f} s = {n}; goodput {s['goodput_rps']:.2f} req/s "
          f"({result['goodput_vs_capacity']:.0%} of capacity; over the {wall:.0f} s until all ended "
          f"{result['goodput_over_wall_vs_capacity']:.0%}), statuses {statuses}, "
          f"compute on expired {result['compute_on_expired']:.0f}; expired because: {reasons}; refused though "
          f"feasible {adm['refused_feasible']} ({adm['refused_feasible_share']:.1%}), accepted then expired "
          f"{adm['accepted_then_expired']} ({adm['accepted_then_expired_share']:.1%}); finish/eta "
          f"{adm['finish_vs_eta']}", flush=True)
    return result


def run(name: str, scheduling: str, args: argparse.Namespace, capacity: float | None,
        phases: tuple[tuple[str, float], ...]) -> dict[str, Any]:
    cfg = bl.model_config(lanes=True, scheduling=scheduling, max_batch_tokens=args.max_batch_tokens, echo=args.echo)
    with bl.stack(cfg, args.redis_url) as st:
        asyncio.run(bl.drive(st.url, workload(8, 99, 60, args.workload)))  # warm-up
        result: dict[str, Any] = {}
        if capacity is None:
            capacity = bl.sustained_capacity(st.url, workload(10_000, args.seed + 7, 600, args.workload), args)
            result["capacity_rps"] = capacity
            print(f"capacity (sustained, {args.capacity_clients} clients back to back, no deadline pressure): "
                  f"{capacity:.2f} req/s", flush=True)
        for i, (phase_name, load) in enumerate(phases):
            label = f"{name}/{phase_name}" if len(phases) > 1 else name
            result[phase_name] = phase(st, label, load * capacity, capacity, args, args.seed + i)
        return result


def table(rows: dict[str, dict[str, Any]]) -> None:
    print(f"\n{'':<24}{'goodput/s':>10}{'of cap':>8}{'/wall':>7}{'ok late':>8}{'expired':>8}{'429':>6}{'wasted':>8}"
          f"{'refused ok':>11}{'acc+exp':>8}")
    for name, r in rows.items():
        adm = r["admission"]
        print(f"{name:<24}{r['goodput_rps']:>10.2f}{r['goodput_vs_capacity']:>8.0%}"
              f"{r['goodput_over_wall_vs_capacity']:>7.0%}{r['succeeded_late']:>8}"
              f"{r['expired']:>8}{r['rejected_429']:>6}{r['compute_on_expired']:>8.0f}"
              f"{adm['refused_feasible_share']:>11.1%}{adm['accepted_then_expired_share']:>8.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("short", "mixed"), default="short")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--steady-load", type=float, default=0.78, help="mixed: the steady phase's share of capacity")
    ap.add_argument("--timeout", type=float, help="per-request timeout_s (default: 3 short, 60 mixed)")
    bl.add_capacity_args(ap, warm_s=10.0, measure_s=30.0)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json")
    ap.add_argument("--echo", nargs="?", const=bl.ECHO_COSTS, default=None,
                    type=lambda v: tuple(float(x) for x in v.split(",")), metavar="STEP_MS,PER_ROW_MS,PER_TOKEN_MS",
                    help="no model: the echo runner with this cost curve (default: the benchmark model's on a CPU)")
    ap.add_argument("--outcomes", help="append every request's outcome here, one JSON line each")
    args = ap.parse_args()
    if args.timeout is None:
        args.timeout = 3.0 if args.workload == "short" else 60.0
    report: dict[str, Any] = {"workload": args.workload, "overload": args.overload, "timeout_s": args.timeout}
    if args.workload == "mixed":
        aware = run("deadline_aware", "deadline", args, None,
                    (("steady", args.steady_load), ("overload", args.overload)))
        capacity = report["capacity_rps"] = aware.pop("capacity_rps")
        report.update({"steady_load": args.steady_load, **aware,
                       "goodput_vs_capacity": aware["overload"]["goodput_vs_capacity"],
                       "goodput_over_wall_vs_capacity": aware["overload"]["goodput_over_wall_vs_capacity"],
                       "compute_on_expired": sum(aware[p]["compute_on_expired"] for p in ("steady", "overload")),
                       "refused_feasible_share": max(aware[p]["admission"]["refused_feasible_share"]
                                                     for p in ("steady", "overload")),
                       "accepted_then_expired_share": max(aware[p]["admission"]["accepted_then_expired_share"]
                                                          for p in ("steady", "overload"))})
        table({f"steady ({args.steady_load:.0%})": aware["steady"],
               f"overload ({args.overload:.0%})": aware["overload"]})
    else:
        aware = run("deadline_aware", "deadline", args, None, (("overload", args.overload),))
        capacity = report["capacity_rps"] = aware.pop("capacity_rps")
        fifo = run("fifo", "fifo", args, capacity, (("overload", args.overload),))
        report.update({"deadline_aware": aware["overload"], "fifo": fifo["overload"],
                       "compute_on_expired": aware["overload"]["compute_on_expired"],
                       "goodput_ratio_vs_fifo": (aware["overload"]["goodput_rps"] / fifo["overload"]["goodput_rps"]
                                                 if fifo["overload"]["goodput_rps"] else None)})
        table({"deadline_aware": report["deadline_aware"], "fifo": report["fifo"]})
    print(f"capacity {capacity:.2f} req/s; compute_on_expired (deadline-aware) {report['compute_on_expired']:.0f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
