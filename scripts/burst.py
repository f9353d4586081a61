"""Latency of single requests and batch sizes under a burst, against a running stack.

    batchgate up --port 8000 &        # prints the worker's metrics URL
    python scripts/burst.py --url http://127.0.0.1:8000 --worker-metrics http://127.0.0.1:PORT/metrics

Prints a table; `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time
from collections import defaultdict

import httpx

EMBED = {"input": {"texts": ["hello world"]}}
GENERATE = {"input": {"prompt": "Once upon a time"}, "params": {"max_new_tokens": 32, "ignore_eos": True}}


async def timed(client: httpx.AsyncClient, model: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = await client.post(f"/v1/models/{model}/requests", params={"wait": 60}, json=body)
    r.raise_for_status()
    if r.status_code != 200:
        raise RuntimeError(f"{model}: no result within the wait: {r.text}")
    return (time.perf_counter() - t0) * 1000


def batch_histogram(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """{(model, lane): {"count": n, "sum": s}} from the worker's batchgate_batch_size histogram."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for m in re.finditer(r'^batchgate_batch_size_(count|sum)\{lane="([^"]+)",model="([^"]+)"\} (\S+)$', text, re.M):
        out[(m.group(3), m.group(2))][m.group(1)] = float(m.group(4))
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--worker-metrics", help="the worker's /metrics URL (for batch sizes)")
    ap.add_argument("--repeat", type=int, default=20, help="single requests per model (median reported)")
    ap.add_argument("--burst", type=int, default=50)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    figures: dict[str, object] = {}
    async with httpx.AsyncClient(base_url=args.url, timeout=120) as client:
        for model, body in (("minilm", EMBED), ("tiny-llama", GENERATE)):
            await timed(client, model, body)  # warm-up
            lat = [await timed(client, model, body) for _ in range(args.repeat)]
            figures[f"single_{model}_ms"] = {"p50": statistics.median(lat), "min": min(lat), "max": max(lat)}
            print(f"single {model:<11} p50 {statistics.median(lat):7.1f} ms  min {min(lat):7.1f}  max {max(lat):7.1f}")
        async with httpx.AsyncClient() as mclient:
            for model, body in (("minilm", EMBED), ("tiny-llama", GENERATE)):
                before = batch_histogram((await mclient.get(args.worker_metrics)).text) if args.worker_metrics else {}
                t0 = time.perf_counter()
                lat = await asyncio.gather(*(timed(client, model, body) for _ in range(args.burst)))
                wall = time.perf_counter() - t0
                row: dict[str, object] = {"wall_s": wall, "p50_ms": statistics.median(lat), "max_ms": max(lat)}
                if args.worker_metrics:
                    after = batch_histogram((await mclient.get(args.worker_metrics)).text)
                    batches = sum(after[k].get("count", 0) - before.get(k, {}).get("count", 0)
                                  for k in after if k[0] == model)
                    requests = sum(after[k].get("sum", 0) - before.get(k, {}).get("sum", 0)
                                   for k in after if k[0] == model)
                    row.update({"batches": batches, "mean_batch_size": requests / batches if batches else 0})
                figures[f"burst_{model}"] = row
                extra = (f"  batches {row['batches']:.0f}  mean batch {row['mean_batch_size']:.1f}"
                         if "batches" in row else "")
                print(f"burst  {model:<11} {args.burst} at once: wall {wall:5.2f} s  p50 {row['p50_ms']:7.1f} ms"
                      f"  max {row['max_ms']:7.1f} ms{extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    asyncio.run(main())
