"""Chaos run against a running stack: kill and restart workers at random under load, then check that
every accepted request reached exactly one terminal state.

Point it at a gateway and the Redis behind it; it starts its own worker processes (with the same
environment: model config, key prefix), so it can kill them:

    batchgate gateway &                                   # or `batchgate up`
    python scripts/chaos.py --url http://127.0.0.1:8000 --workers 2 --minutes 5 --json docs/bench/chaos.json

Prints a progress line every 10 s and the ledger at the end: accepted, terminal by status, lost,
visible duplicates, re-executions, kills.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

TERMINAL = {"succeeded", "failed", "expired", "cancelled"}


class Workers:
    def __init__(self, n: int, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.kills = {"SIGKILL": 0, "SIGTERM": 0}
        self.started = 0
        for i in range(n):
            self.start(f"chaos-w{i}")

    def start(self, name: str) -> None:
        env = {**os.environ, "BATCHGATE_WORKER_NAME": f"{name}-{self.started}", "BATCHGATE_WORKER_METRICS_PORT": "0"}
        log = (self.log_dir / f"{name}.log").open("a")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "batchgate", "worker"], env=env, stdout=log,
                                            stderr=subprocess.STDOUT)
        self.started += 1

    def hurt(self, rng: random.Random) -> str:
        name = rng.choice(sorted(self.procs))
        sig = signal.SIGKILL if rng.random() < 0.7 else signal.SIGTERM
        self.procs[name].send_signal(sig)
        self.kills[sig.name] += 1
        return f"{sig.name} {name}"

    def revive(self) -> None:
        for name, p in list(self.procs.items()):
            if p.poll() is not None:
                self.start(name)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def body(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.2:
        return {"input": {"input_ids": [rng.randrange(3, 8000) for _ in range(200)]},
                "params": {"max_new_tokens": 128, "ignore_eos": True}, "timeout_s": 120}
    return {"input": {"input_ids": [rng.randrange(3, 8000) for _ in range(rng.choice((8, 32, 64)))]},
            "params": {"max_new_tokens": rng.choice((8, 16, 32)), "ignore_eos": True}, "timeout_s": 120}


class Run:
    """Load, chaos and progress for one chaos run; the ledger at the end."""

    def __init__(self, args: argparse.Namespace, workers: Workers) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workers = workers
        self.accepted: list[str] = []
        self.refused: dict[int, int] = {}
        self.events: list[str] = []
        self.end = time.monotonic() + args.minutes * 60

    async def submit(self, client: httpx.AsyncClient) -> None:
        try:
            r = await client.post(f"/v1/models/{self.args.model}/requests", json=body(self.rng))
        except httpx.HTTPError:
            self.refused[0] = self.refused.get(0, 0) + 1
            return
        if r.status_code == 202:
            self.accepted.append(r.json()["id"])
        else:
            self.refused[r.status_code] = self.refused.get(r.status_code, 0) + 1

    async def load(self, client: httpx.AsyncClient) -> None:
        tasks = []
        while time.monotonic() < self.end:
            tasks.append(asyncio.create_task(self.submit(client)))
            await asyncio.sleep(self.rng.expovariate(self.args.rate))
        await asyncio.gather(*tasks)

    async def chaos(self) -> None:
        while time.monotonic() < self.end:
            await asyncio.sleep(self.rng.expovariate(1 / self.args.kill_every))
            if time.monotonic() >= self.end:
                break
            self.events.append(self.workers.hurt(self.rng))
            await asyncio.sleep(self.rng.uniform(0.5, 3.0))
            self.workers.revive()

    async def progress(self) -> None:
        t0 = time.monotonic()
        while time.monotonic() < self.end:
            await asyncio.sleep(10)
            print(f"[{time.monotonic() - t0:5.0f} s] accepted {len(self.accepted)}, refused {self.refused}, "
                  f"kills {self.workers.kills}", flush=True)

    async def settle(self, client: httpx.AsyncClient) -> tuple[dict[str, dict[str, Any]], int]:
        final: dict[str, dict[str, Any]] = {}

        async def one(rid: str) -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                r = await client.get(f"/v1/requests/{rid}", params={"wait": 30})
                if r.status_code == 200 and r.json()["status"] in TERMINAL:
                    final[rid] = r.json()
                    return
        await asyncio.gather(*(one(rid) for rid in self.accepted))
        again = await asyncio.gather(*(client.get(f"/v1/requests/{rid}") for rid in final))
        changed = sum(1 for a in again if (a.json()["status"], a.json()["finished_at"])
                      != (final[a.json()["id"]]["status"], final[a.json()["id"]]["finished_at"]))
        return final, changed


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    ap.add_argument("--kill-every", type=float, default=15.0, help="mean seconds between worker kills")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=os.environ.get("BATCHGATE_API_KEY"), help="if the gateway requires keys")
    ap.add_argument("--json")
    args = ap.parse_args()
    log_dir = Path(os.environ.get("CHAOS_LOG_DIR", "bench-results/chaos-logs"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = Workers(args.workers, log_dir)
    run = Run(args, workers)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, timeout=180, headers=headers,
                                 limits=httpx.Limits(max_connections=500)) as client:
        await asyncio.gather(run.load(client), run.chaos(), run.progress())
        workers.revive()
        print("load stopped; waiting for every accepted request to finish", flush=True)
        t_settle = time.monotonic()
        final, changed = await run.settle(client)
        settle_s = time.monotonic() - t_settle
    workers.stop()
    statuses: dict[str, int] = {}
    for rec in final.values():
        statuses[rec["status"]] = statuses.get(rec["status"], 0) + 1
    report = {
        "minutes": args.minutes, "workers": args.workers, "rate_rps": args.rate, "accepted": len(run.accepted),
        "refused_at_submit": run.refused, "terminal": len(final), "lost": len(run.accepted) - len(final),
        "visible_duplicates": changed, "statuses": statuses,
        "re_executed": sum(1 for r in final.values() if r.get("attempts", 0) > 1),
        "kills": workers.kills, "worker_starts": workers.started, "settle_s": round(settle_s, 1),
        "events": run.events,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
