"""Shared pieces of the whole-stack benchmarks: start a stack, drive open-loop load, summarise."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from shared.redis_io import delete_prefix_sync, make_sync_redis

MODEL = "bench-llama"
SHORT_PROMPTS = (16, 32, 64)
SHORT_OUTPUTS = (8, 16, 32)
LONG_PROMPT = 256
LONG_OUTPUT = 128


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    idx: int
    cls: str  # "short" | "long"
    prompt: list[int]
    out: int
    at: float = 0.0  # arrival, seconds after the start
    timeout_s: float = 30.0


@dataclass
class Outcome:
    job: Job
    http: int = 0
    status: str = ""
    submitted: float = 0.0  # perf_counter
    done: float = 0.0
    ttft_ms: float | None = None
    finished_at: float | None = None  # epoch seconds, from the record
    deadline: float | None = None
    error: str = ""
    eta_ms: float | None = None  # the gateway's estimated finish at submit (202 only)
    queue_ms: float | None = None  # from its submit to its start, as the worker measured it

    @property
    def latency_ms(self) -> float:
        return (self.done - self.submitted) * 1000

    @property
    def in_deadline(self) -> bool:
        return (self.status == "succeeded" and self.finished_at is not None and self.deadline is not None
                and self.finished_at <= self.deadline)


def mix(n: int, seed: int, long_share: float = 0.3, vocab: int = 8192, long: bool = True) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        if long and rng.random() < long_share:
            cls, plen, out = "long", LONG_PROMPT, LONG_OUTPUT
        else:
            cls, plen, out = "short", rng.choice(SHORT_PROMPTS), rng.choice(SHORT_OUTPUTS)
        jobs.append(Job(i, cls, [rng.randrange(3, vocab) for _ in range(plen)], out))
    return jobs


def mixed(n: int, seed: int, vocab: int = 8192, prompts: tuple[int, int] = (16, 256),
          outputs: tuple[int, int] = (8, 128)) -> list[Job]:
    """A mixed workload: prompt and output lengths uniform over the given ranges. Class "short" when the whole
    request fits the default short lane (<= 128 tokens), else "long"."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        plen, out = rng.randint(*prompts), rng.randint(*outputs)
        jobs.append(Job(i, "short" if plen + out <= 128 else "long", [rng.randrange(3, vocab) for _ in range(plen)],
                        out))
    return jobs


def poisson(jobs: list[Job], rate: float, seed: int) -> None:
    rng = random.Random(seed)
    t = 0.0
    for job in jobs:
        t += rng.expovariate(rate)
        job.at = t


# The benchmark model's costs on this project's 2-core CPU (`python scripts/step_costs.py`: a decode step ~15 ms at one
# row growing to ~35 ms at 32, a 256-token prefill ~100 ms), as the echo runner's cost curve: the stack with a
# model's timing and none of its compute, so what a benchmark measures is the scheduling, not the machine's noise.
ECHO_COSTS = (14.0, 0.7, 0.35)


def model_config(*, lanes: bool, scheduling: str = "deadline", max_running: int = 64, max_batch_size: int = 32,
                 max_batch_tokens: int = 1024, short_engine: bool = False,
                 long_rows: int | None = None, echo: tuple[float, float, float] | None = None) -> dict[str, Any]:
    """The benchmark model's config. `lanes`: the default lanes as shipped (`shared.lanes.DEFAULT_LANES`); with
    `short_engine`, the short lane on an engine of its own; without lanes, one lane (FIFO when
    `scheduling="fifo"`); `long_rows`: the model setting (None: the default); `echo`: no model, the echo runner
    with this cost curve instead (`step_ms`, `step_ms_per_row`, `prefill_ms_per_token`; see `ECHO_COSTS`)."""
    from shared.lanes import DEFAULT_LANES

    spec: dict[str, Any] = {
        "name": MODEL, "task": "generate", "source": "builtin:bench-llama", "scheduling": scheduling,
        "max_running": max_running, "max_batch_size": max_batch_size, "max_batch_tokens": max_batch_tokens,
        "max_input_tokens": 384, "max_new_tokens": 256, "max_timeout_s": 600,
    }
    if echo is not None:
        spec.update({"kind": "echo", "source": "",
                     **dict(zip(("step_ms", "step_ms_per_row", "prefill_ms_per_token"), echo, strict=True))})
    if long_rows is not None:
        spec["long_rows"] = long_rows
    if lanes:
        spec["lanes"] = [{"name": ln.name, "max_tokens": ln.max_tokens, "window_ms": ln.window_ms,
                          "max_backlog": 100_000, "max_share": ln.max_share,
                          "engine": "short" if short_engine and i == 0 else ln.engine}
                         for i, ln in enumerate(DEFAULT_LANES)]
    else:
        spec["lanes"] = [{"name": "all", "window_ms": 10, "max_backlog": 100_000}]
    return {"models": [spec]}


@dataclass
class Stack:
    url: str
    worker_metrics: str
    prefix: str
    redis_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


@contextlib.contextmanager
def stack(config: dict[str, Any], redis_url: str, *, log_dir: Path | None = None,
          parts: tuple[str, ...] = ("worker", "gateway"), env_extra: dict[str, str] | None = None) -> Iterator[Stack]:
    """A gateway and a worker as subprocesses (`batchgate gateway` / `batchgate worker`; `parts` may add
    `batches`, the Batch API's runner), own key prefix."""
    prefix = f"bgbench-{secrets.token_hex(3)}"
    port, mport = free_port(), free_port()
    tmp = tempfile.TemporaryDirectory(prefix="batchgate-bench-")
    cfg = Path(tmp.name) / "models.yaml"
    cfg.write_text(yaml.safe_dump(config))
    env = {**os.environ, "BATCHGATE_CONFIG": str(cfg), "BATCHGATE_REDIS_URL": redis_url,
           "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_PORT": str(port), "BATCHGATE_WORKER_METRICS_PORT": str(mport),
           "BATCHGATE_LOG_LEVEL": "warning", "BATCHGATE_LOG_FORMAT": "json", "BATCHGATE_MAX_WAIT_S": "600",
           "BATCHGATE_AUTH": "off", "BATCHGATE_FILES_DIR": str(Path(tmp.name) / "files"), **(env_extra or {})}
    logs = log_dir or Path(tmp.name)
    cli = [sys.executable, "-m", "batchgate"]
    procs = [subprocess.Popen([*cli, role], env=env, stdout=(logs / f"{prefix}-{role}.log").open("w"),
                              stderr=subprocess.STDOUT) for role in parts]
    st = Stack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{mport}/metrics", prefix, redis_url, procs)
    try:
        _wait_ready(st)
        yield st
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        delete_prefix_sync(redis_url, prefix)
        tmp.cleanup()


def _wait_ready(st: Stack, timeout: float = 300) -> None:
    client = make_sync_redis(st.redis_url)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if any(p.poll() is not None for p in st.procs):
            raise RuntimeError("a stack process exited during start-up")
        try:
            ok = httpx.get(st.url + "/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            ok = False
        if ok and client.hlen(f"{st.prefix}:workers"):
            client.close()
            return
        time.sleep(0.2)
    raise RuntimeError("stack did not become ready")


def scrape(url: str, name: str) -> float:
    """Sum of a Prometheus counter/gauge over its labels."""
    text = httpx.get(url, timeout=5).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


async def run_one(client: httpx.AsyncClient, job: Job, t0: float, wait_s: float = 600, *,
                  sync: bool = True) -> Outcome:
    """Submit `job` at its arrival time and follow it to its end. `sync`: the submit itself waits for the result
    (`?wait=`); otherwise the 202 (with the gateway's `eta_ms`) comes back at once and the result is long-polled."""
    delay = t0 + job.at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    o = Outcome(job, submitted=time.perf_counter())
    body = {"input": {"input_ids": job.prompt}, "params": {"max_new_tokens": job.out, "ignore_eos": True},
            "timeout_s": job.timeout_s}
    try:
        r = await client.post(f"/v1/models/{MODEL}/requests", params={"wait": wait_s} if sync else {}, json=body)
        o.http = r.status_code
        data = r.json()
        o.eta_ms = data.get("eta_ms")
        while r.status_code == 202 or (r.status_code == 200 and data.get("status") in ("queued", "running")):
            r = await client.get(f"/v1/requests/{data['id']}", params={"wait": wait_s})
            data = r.json()
        o.status = data.get("status") or data.get("error", {}).get("code", "")
        if isinstance(data.get("error"), dict):
            o.error = data["error"].get("message", "")
        timings = data.get("timings") or {}
        o.queue_ms = timings.get("queue_ms")
        if "ttft_ms" in timings and o.queue_ms is not None:
            o.ttft_ms = o.queue_ms + timings["ttft_ms"]
        o.finished_at = data.get("finished_at")
        o.deadline = data.get("deadline")
    except (httpx.HTTPError, ValueError) as exc:
        o.status, o.error = "client_error", repr(exc)
    o.done = time.perf_counter()
    return o


async def drive(url: str, jobs: list[Job], wait_s: float = 600, *, sync: bool = True) -> tuple[list[Outcome], float]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=url, timeout=wait_s + 30, limits=limits) as client:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(run_one(client, j, t0, wait_s, sync=sync) for j in jobs))
        return list(outs), time.perf_counter() - t0


async def saturate(url: str, jobs: Iterator[Job], *, concurrency: int, warm_s: float, measure_s: float,
                   progress: str = "") -> float:
    """Sustained capacity: `concurrency` clients submit back to back (a queue always waiting, so the worker's
    rows stay full) and the successes that finish in the `measure_s` after a `warm_s` warm-up are counted.
    A burst of N all at once undercounts: its wall time includes the start-up and a tail in which the last
    rows finish in ever smaller batches (under overload, goodput came out above such a "capacity")."""
    limits = httpx.Limits(max_connections=concurrency + 10, max_keepalive_connections=concurrency + 10)
    counted = 0
    async with httpx.AsyncClient(base_url=url, timeout=600 + 30, limits=limits) as client:
        t0 = time.perf_counter()
        start, end = t0 + warm_s, t0 + warm_s + measure_s

        async def client_loop() -> None:
            nonlocal counted
            while time.perf_counter() < end:
                job = next(jobs)
                o = await run_one(client, job, time.perf_counter() - job.at)  # now, whatever its arrival time
                if o.status == "succeeded" and start <= o.done <= end:
                    counted += 1

        async def show() -> None:
            while time.perf_counter() < end:
                await asyncio.sleep(5)
                print(f"  {progress}capacity: {time.perf_counter() - t0:.0f}/{warm_s + measure_s:.0f} s, "
                      f"{counted} counted", flush=True)

        ticker = asyncio.create_task(show())
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        ticker.cancel()
    if counted == 0:  # a capacity of 0 would only fail later, as a division by zero in the offered rate
        raise SystemExit(f"{progress}capacity: no request finished within the {measure_s:g} s measured "
                         f"(after {warm_s:g} s of warm-up); a loaded machine needs a longer --capacity-s")
    return counted / measure_s


def add_capacity_args(ap: argparse.ArgumentParser, *, warm_s: float, measure_s: float) -> None:
    ap.add_argument("--capacity-clients", type=int, default=128,
                    help="closed-loop clients measuring capacity (2x the model's 64 rows: a queue always waits)")
    ap.add_argument("--capacity-warm-s", type=float, default=warm_s)
    ap.add_argument("--capacity-s", type=float, default=measure_s, help="seconds over which capacity is counted")


def sustained_capacity(url: str, jobs: list[Job], args: argparse.Namespace, progress: str = "") -> float:
    """`saturate` over `jobs` (cycled) with no deadline pressure, sized by the `add_capacity_args` options."""
    for j in jobs:
        j.timeout_s = 600
    return asyncio.run(saturate(url, itertools.cycle(jobs), concurrency=args.capacity_clients,
                                warm_s=args.capacity_warm_s, measure_s=args.capacity_s, progress=progress))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def summarise(outs: list[Outcome], span_s: float) -> dict[str, Any]:
    """Per class (short/long) and overall: latency and TTFT percentiles, throughput, goodput."""
    result: dict[str, Any] = {"classes": {}}
    for cls in ("short", "long", "all"):
        sel = [o for o in outs if cls == "all" or o.job.cls == cls]
        if not sel:
            continue
        ok = [o for o in sel if o.status == "succeeded"]
        lat = [o.latency_ms for o in ok]
        ttft = [o.ttft_ms for o in ok if o.ttft_ms is not None]
        row = {
            "requests": len(sel), "succeeded": len(ok),
            "in_deadline": sum(o.in_deadline for o in sel),
            "expired": sum(o.status == "expired" for o in sel),
            "rejected_429": sum(o.http == 429 for o in sel),
            "failed": sum(o.status not in ("succeeded", "expired") and o.http != 429 for o in sel),
            "throughput_rps": len(ok) / span_s, "goodput_rps": sum(o.in_deadline for o in sel) / span_s,
            "deadline_miss_rate": 1 - sum(o.in_deadline for o in sel) / len(sel),
        }
        for q, name in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
            row[f"latency_{name}_ms"] = pct(lat, q)
            row[f"ttft_{name}_ms"] = pct(ttft, q)
        result["classes"][cls] = row
    return result


# A refused request counts as "would have finished in time" when an accepted request at least as long (prompt and
# output) was submitted within this many seconds of it and finished within the refused one's timeout.
NEIGHBOUR_S = 3.0


def misjudged(outs: list[Outcome]) -> dict[str, Any]:
    """Admission's two mistakes, as shares of all requests: refusals (429 deadline_infeasible) of requests that
    would have finished in time, judged by their neighbours (see NEIGHBOUR_S), and requests accepted that then
    expired. Also how the gateway's estimate compared with the measured finish (actual / eta, per class).
    The neighbour judge asks whether each refused request alone could have finished, not whether all could:
    it means most where refusals should be rare (load under capacity, deadlines long against the queue)."""
    done = sorted((o for o in outs if o.status == "succeeded"), key=lambda o: o.submitted)
    refused = [o for o in outs if o.http == 429 and "deadline" in (o.status + o.error)]

    def feasible(r: Outcome) -> bool:
        return any(abs(a.submitted - r.submitted) <= NEIGHBOUR_S and len(a.job.prompt) >= len(r.job.prompt)
                   and a.job.out >= r.job.out and a.latency_ms <= r.job.timeout_s * 1000 for a in done)

    wrong = [r for r in refused if feasible(r)]
    accepted_expired = [o for o in outs if o.http in (200, 202) and o.status == "expired"]
    ratios: dict[str, Any] = {}
    for cls in ("short", "long"):
        xs = sorted(o.latency_ms / o.eta_ms for o in done if o.job.cls == cls and o.eta_ms)
        if xs:
            ratios[cls] = {"n": len(xs), "p10": pct(xs, 0.1), "p50": pct(xs, 0.5), "p90": pct(xs, 0.9)}
    n = max(1, len(outs))
    return {"refused_deadline": len(refused), "refused_feasible": len(wrong), "refused_feasible_share": len(wrong) / n,
            "accepted_then_expired": len(accepted_expired), "accepted_then_expired_share": len(accepted_expired) / n,
            "finish_vs_eta": ratios}
