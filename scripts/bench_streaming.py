"""Streaming benchmark: what streaming tokens over HTTP costs, on the whole stack (gateway over HTTP, Redis,
one worker with the engine benchmark's model), in one run:

- the gateway's added delay to the first token: the time a caller's first streamed token arrives (the
  `delta` event of `POST ... stream:true` with `Accept: text/event-stream`) minus the time the engine
  produced it (the result's `started_at` + `ttft_ms`; one clock, one machine), p50/p99. Measured with one
  request at a time (the path alone) and under the e2e workload at capacity (every request streaming);
- throughput of the e2e workload (70% short, 30% long; `benchlib.mix`) with every request streaming
  against none streaming (the submit waits for the result): closed-loop clients keep the worker's rows
  full; the two take turns over --rounds so a slow spell of this shared VM lands on both. Goal:
  `streaming_throughput_ratio` >= 0.95.

    python scripts/bench_streaming.py --json docs/bench/streaming.json
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import benchlib as bl
import httpx


@dataclass
class Streamed:
    ok: bool
    added_ms: float | None = None  # first delta at the caller - first token at the engine
    http_ttft_ms: float | None = None  # first delta at the caller - submit sent
    engine_ttft_ms: float | None = None
    deltas: int = 0


async def stream_one(client: httpx.AsyncClient, job: bl.Job) -> Streamed:
    body = {"input": {"input_ids": job.prompt}, "params": {"max_new_tokens": job.out, "ignore_eos": True},
            "timeout_s": 600, "stream": True}
    sent = time.time()
    first: float | None = None
    deltas = 0
    done: dict[str, Any] | None = None
    # cheap on purpose (the client shares the machine with what it measures): events are counted in the raw
    # bytes, and only the final event is parsed
    prev, tail = b"", b""
    async with client.stream("POST", f"/v1/models/{bl.MODEL}/requests", json=body,
                             headers={"Accept": "text/event-stream"}) as r:
        if r.status_code != 200:
            return Streamed(False)
        async for chunk in r.aiter_bytes():
            deltas += chunk.count(b"event: delta")
            if first is None and b"event: delta" in prev[-16:] + chunk:
                first = time.time()
            if tail or b"event: done" in prev[-16:] + chunk:
                tail = tail + chunk if tail else prev + chunk
            prev = chunk
    at = tail.find(b"event: done")
    if at >= 0:
        line = tail[at:].split(b"data: ", 1)[1].split(b"\n", 1)[0]
        done = json.loads(line)
    if done is None or done.get("status") != "succeeded" or first is None:
        return Streamed(False)
    engine_first = done["started_at"] + done["timings"]["ttft_ms"] / 1000
    return Streamed(True, (first - engine_first) * 1000, (first - sent) * 1000, done["timings"]["ttft_ms"], deltas)


async def wait_one(client: httpx.AsyncClient, job: bl.Job) -> bool:
    o = await bl.run_one(client, job, time.perf_counter() - job.at)
    return o.status == "succeeded"


async def closed_loop(url: str, jobs: Iterator[bl.Job], *, streaming: bool, clients: int, warm_s: float,
                      measure_s: float, samples: list[Streamed]) -> float:
    """Completions per second over `measure_s` after `warm_s`, `clients` back to back."""
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=clients + 10)
    counted = 0
    async with httpx.AsyncClient(base_url=url, timeout=630, limits=limits) as client:
        t0 = time.perf_counter()
        start, end = t0 + warm_s, t0 + warm_s + measure_s

        async def loop() -> None:
            nonlocal counted
            while time.perf_counter() < end:
                job = next(jobs)
                if streaming:
                    s = await stream_one(client, job)
                    ok = s.ok
                    if ok and start <= time.perf_counter() <= end:
                        samples.append(s)
                else:
                    ok = await wait_one(client, job)
                if ok and start <= time.perf_counter() <= end:
                    counted += 1

        await asyncio.gather(*(loop() for _ in range(clients)))
    return counted / measure_s


async def alone(url: str, jobs: list[bl.Job]) -> list[Streamed]:
    async with httpx.AsyncClient(base_url=url, timeout=630) as client:
        return [await stream_one(client, job) for job in jobs]


def stats(values: list[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "p50": bl.pct(values, 0.5), "p99": bl.pct(values, 0.99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--alone", type=int, default=100, help="requests streamed one at a time")
    ap.add_argument("--clients", type=int, default=96, help="closed-loop clients (the model has 64 rows)")
    ap.add_argument("--rounds", type=int, default=3, help="turns each of streaming / not streaming takes")
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--measure-s", type=float, default=30.0, help="seconds counted per turn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    ap.add_argument("--json")
    args = ap.parse_args()

    jobs = bl.mix(400, args.seed)
    for j in jobs:  # no deadline pressure in either mode: admission must not pick which requests run
        j.timeout_s = 600
    report: dict[str, Any] = {"config": vars(args)}
    with bl.stack(bl.model_config(lanes=True), args.redis_url) as st:
        print(f"one at a time: {args.alone} streamed requests", flush=True)
        asyncio.run(alone(st.url, jobs[:5]))  # warm-up
        solo = [s for s in asyncio.run(alone(st.url, jobs[:args.alone])) if s.ok]
        rates: dict[str, list[float]] = {"none": [], "streaming": []}
        loaded: list[Streamed] = []
        cycle = itertools.cycle(jobs)
        for r in range(args.rounds):
            for mode in (("none", "streaming") if r % 2 == 0 else ("streaming", "none")):
                rate = asyncio.run(closed_loop(st.url, cycle, streaming=mode == "streaming", clients=args.clients,
                                               warm_s=args.warm_s, measure_s=args.measure_s, samples=loaded))
                rates[mode].append(rate)
                print(f"  round {r + 1}/{args.rounds} {mode}: {rate:.2f} req/s", flush=True)
    none, streaming = statistics.median(rates["none"]), statistics.median(rates["streaming"])
    report.update({
        "alone": {"added_ms": stats([s.added_ms for s in solo if s.added_ms is not None]),
                  "http_ttft_ms": stats([s.http_ttft_ms for s in solo if s.http_ttft_ms is not None]),
                  "engine_ttft_ms": stats([s.engine_ttft_ms for s in solo if s.engine_ttft_ms is not None])},
        "at_capacity": {"added_ms": stats([s.added_ms for s in loaded if s.added_ms is not None]),
                        "deltas_per_request": statistics.mean(s.deltas for s in loaded) if loaded else None},
        "throughput_rps": rates,
        "throughput_none_rps": none, "throughput_streaming_rps": streaming,
        "streaming_throughput_ratio": streaming / none if none else None,
    })
    a, c = report["alone"], report["at_capacity"]
    print(f"\n{'':24}{'p50 ms':>10}{'p99 ms':>10}{'n':>6}")
    for name, s in (("added, one at a time", a["added_ms"]), ("engine TTFT, alone", a["engine_ttft_ms"]),
                    ("HTTP TTFT, alone", a["http_ttft_ms"]), ("added, at capacity", c["added_ms"])):
        print(f"{name:24}{s['p50'] or 0:>10.2f}{s['p99'] or 0:>10.2f}{s['n']:>6}")
    print(f"\nthroughput: none {none:.2f} req/s, every request streaming {streaming:.2f} req/s "
          f"(ratio {report['streaming_throughput_ratio']:.3f}; goal >= 0.95)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
