"""Webhook head-of-line benchmark: does one tarpit receiver slow other tenants' deliveries?

Runs the real dispatcher against a real Redis twice in one process, side by side:
- `no_tarpit`: `--tenants` normal receivers (answer after `--normal-ms`), deliveries at `--rate` per second
  for `--duration` seconds, spread over the tenants;
- `tarpit`: the same, plus one more tenant whose receiver answers after `--tarpit-s` seconds, receiving
  `--tarpit-rate` deliveries per second.
Latency = event created (the `created_ms` the finish script stamps) -> the receiver has the request. Reported
for the normal tenants only: p50, p99, max, and the tarpit/no-tarpit ratio of p50 and p99 (goal: <= 2).
Everything binds 127.0.0.1; keys live under a fresh prefix, deleted afterwards.

    python scripts/bench_webhooks.py [--redis-url redis://127.0.0.1:6379/0] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import secrets
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gateway.dispatcher import Dispatcher
from shared.codec import encode
from shared.config import Settings
from shared.keys import Keys
from shared.logs import configure_logging
from shared.messages import CallbackDelivery
from shared.redis_io import delete_prefix_sync, make_redis


class Rx:
    """A minimal HTTP/1.1 receiver on 127.0.0.1 that answers 200 after `delay_s` and notes arrival times."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.arrived: dict[str, float] = {}  # webhook-id -> epoch seconds
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                _ = line
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                await reader.readexactly(int(headers.get("content-length", 0)))
                self.arrived.setdefault(headers.get("webhook-id", ""), time.time())
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, asyncio.CancelledError):
            pass  # cancelled: the tarpit still sleeping when the run ends
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


async def scenario(args: argparse.Namespace, tarpit: bool) -> dict[str, Any]:
    prefix = f"bgbench-{secrets.token_hex(4)}"
    keys = Keys(prefix)
    settings = Settings(redis_url=args.redis_url, key_prefix=prefix, callback_allow="127.0.0.0/8",
                        callback_timeout_s=args.tarpit_s + 2, callback_connect_timeout_s=2.0,
                        callback_lease_s=60.0, callback_base_s=1.0, callback_cap_s=5.0,
                        worker_name=f"{prefix}-d", worker_metrics_port=0).validate()
    redis = make_redis(args.redis_url)
    normal = [Rx(args.normal_ms / 1000) for _ in range(args.tenants)]
    slow = Rx(args.tarpit_s)
    for rx in [*normal, slow]:
        await rx.start()
    d = Dispatcher(settings, default_secret="whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", rng=random.Random(0))
    stop = asyncio.Event()
    task = asyncio.create_task(d.run(stop))
    await d.ready.wait()
    sent: dict[str, tuple[int, float]] = {}  # delivery id -> (normal receiver index, created)
    n_normal = int(args.rate * args.duration)
    n_tarpit = int(args.tarpit_rate * args.duration) if tarpit else 0
    events = [(i * args.duration / n_normal, "n", i) for i in range(n_normal)]
    events += [(i * args.duration / max(1, n_tarpit), "t", i) for i in range(n_tarpit)]
    events.sort()
    t0 = time.monotonic()
    try:
        for at, kind, i in events:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            did = f"msg_{kind}{i}_{secrets.token_hex(4)}"
            if kind == "n":
                idx = i % args.tenants
                url, tenant = f"http://127.0.0.1:{normal[idx].port}/hook", f"tenant{idx}"
            else:
                url, tenant = f"http://127.0.0.1:{slow.port}/hook", "tarpit"
            now = time.time()
            delivery = CallbackDelivery(did, f"req_{did}", tenant, "completed", url, int(now * 1000))
            await redis.xadd(keys.callback_stream(), {"d": encode(delivery)})
            if kind == "n":
                sent[did] = (idx, int(now * 1000) / 1000)
        give_up = time.monotonic() + args.grace_s
        while time.monotonic() < give_up and any(did not in normal[i].arrived for did, (i, _) in sent.items()):
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, 30)
        for rx in [*normal, slow]:
            rx.close()
        await redis.aclose()
        delete_prefix_sync(args.redis_url, prefix)
    lat = [normal[i].arrived[did] - created for did, (i, created) in sent.items() if did in normal[i].arrived]
    return {"tarpit": tarpit, "normal_deliveries": len(sent), "normal_delivered": len(lat),
            "tarpit_deliveries": n_tarpit, "tarpit_received": len(slow.arrived),
            "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "max_s": max(lat) if lat else None}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / max(b, 1e-3)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    base = await scenario(args, tarpit=False)
    with_tarpit = await scenario(args, tarpit=True)
    return {"config": {k: v for k, v in vars(args).items() if k not in ("json", "redis_url")},
            "no_tarpit": base, "tarpit": with_tarpit,
            "p50_ratio": ratio(with_tarpit["p50_s"], base["p50_s"]),
            "p99_ratio": ratio(with_tarpit["p99_s"], base["p99_s"]),
            "note": "ratios divide by max(no-tarpit figure, 1 ms)"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--tenants", type=int, default=4, help="normal receivers (one tenant each)")
    ap.add_argument("--rate", type=float, default=40.0, help="deliveries per second to the normal receivers")
    ap.add_argument("--normal-ms", type=float, default=5.0, help="a normal receiver's answer time")
    ap.add_argument("--tarpit-s", type=float, default=5.0, help="the tarpit receiver's answer time")
    ap.add_argument("--tarpit-rate", type=float, default=5.0, help="deliveries per second to the tarpit")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of load per scenario")
    ap.add_argument("--grace-s", type=float, default=30.0, help="how long to wait for stragglers")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args(argv)
    configure_logging("WARNING", "console")
    report = asyncio.run(main_async(args))

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    print(f"{'scenario':<10} {'delivered':>11} {'p50 s':>8} {'p99 s':>8} {'max s':>8}")
    for name in ("no_tarpit", "tarpit"):
        r = report[name]
        print(f"{name:<10} {r['normal_delivered']:>5}/{r['normal_deliveries']:<5} {f(r['p50_s']):>8} "
              f"{f(r['p99_s']):>8} {f(r['max_s']):>8}")
    print(f"other tenants, tarpit / no tarpit: p50 x{f(report['p50_ratio'])}, p99 x{f(report['p99_ratio'])} "
          f"(goal: <= 2); tarpit answered after {args.tarpit_s} s, {report['tarpit']['tarpit_received']} "
          f"of {report['tarpit']['tarpit_deliveries']} tarpit deliveries reached it")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
