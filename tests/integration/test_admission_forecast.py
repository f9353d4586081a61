"""Admission's forecast against measured finish times, on the whole stack (gateway, Redis, worker) under a
mixed overload. The echo model with a cost curve (`step_ms`, `step_ms_per_row`, `prefill_ms_per_token`) stands
in for a model on a CPU: a step's time grows with its rows, a start's with its prompt, and sleeping costs no CPU,
so what is measured is the scheduling and the estimate, not the machine's noise."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

import httpx
import pytest

from shared.config import ModelSpec
from shared.states import Task
from tests.integration.test_stack import wait_until
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

ECHO = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=256,
                 max_new_tokens=128, max_running=8, step_ms=20.0, step_ms_per_row=1.0,
                 prefill_ms_per_token=0.1).validate()
TIMEOUT_S = 15.0
RATE = 10.0  # requests/s: about twice what 8 rows at these costs finish
SPAN_S = 20.0


def workload(seed: int) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, new tokens): Poisson arrivals, prompts 16-200, outputs 8-100, uniform."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(RATE)
        if t > SPAN_S:
            return out
        out.append((t, rng.randint(16, 200), rng.randint(8, 100)))


async def one(client: httpx.AsyncClient, t0: float, at: float, prompt: int, new: int) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
    body = {"input": {"input_ids": [65 + i % 26 for i in range(prompt)]}, "params": {"max_new_tokens": new},
            "timeout_s": TIMEOUT_S}
    sent = time.monotonic()
    r = await client.post("/v1/models/echo/requests", json=body)
    out: dict[str, Any] = {"http": r.status_code, "lane": "short" if prompt + new <= 128 else "medium"}
    if r.status_code != 202:
        return out
    data = r.json()
    out["eta_s"] = data["eta_ms"] / 1000 if data.get("eta_ms") is not None else None
    while data["status"] in ("queued", "running"):
        data = (await client.get(f"/v1/requests/{data['id']}", params={"wait": 30})).json()
    out.update(status=data["status"], latency_s=time.monotonic() - sent,
               late_s=data["finished_at"] - data["deadline"] if data.get("finished_at") else None,
               tokens=len((data.get("output") or {}).get("tokens") or []), new=new,
               in_deadline=data["status"] == "succeeded" and data["finished_at"] <= data["deadline"])
    return out


async def test_admitted_requests_finish_by_their_deadline_near_the_time_admission_forecast(redis_url, prefix):
    settings = make_settings(redis_url, prefix, models=(ECHO,))
    async with running_worker(settings, {}), running_gateway(settings) as gw:
        warm = [one(gw.client, time.monotonic(), 0.0, 32, 16) for _ in range(8)]  # the worker measures its costs
        assert all(o["status"] == "succeeded" for o in await asyncio.gather(*warm))
        await asyncio.sleep(1.5)  # its figures are published (every 0.5 s) and read by admission
        t0 = time.monotonic()
        outs = await asyncio.gather(*(one(gw.client, t0, *job) for job in workload(seed=7)))
    admitted = [o for o in outs if o["http"] == 202]
    refused = [o for o in outs if o["http"] == 429]
    assert {o["http"] for o in outs} <= {202, 429} and refused, "twice the capacity: admission must refuse some"
    assert all(o["status"] in ("succeeded", "expired") for o in admitted)
    # nothing admitted that then missed its deadline: it finished in time, or (a few at most) expired unstarted
    late = [o for o in admitted if o["status"] == "succeeded" and not o["in_deadline"]]
    assert not late, [{k: o[k] for k in ("lane", "eta_s", "latency_s", "late_s", "tokens", "new")} for o in late]
    assert sum(o["status"] == "expired" for o in admitted) <= 0.03 * len(admitted)
    # the medium lane waits behind a queue that the short lane's arrivals keep cutting into: its requests finish
    # near the time admission forecast, neither much later (1.09-1.10x measured; 1.49x, and 7% expired, when the
    # estimate counted every lane's completions as the medium lane's drain) nor much sooner
    ratios = [o["latency_s"] / o["eta_s"] for o in admitted if o["status"] == "succeeded" and o["lane"] == "medium"
              and o["eta_s"] and o["eta_s"] > 2.0]
    assert len(ratios) >= 20
    assert 0.6 <= statistics.median(ratios) <= 1.25, sorted(ratios)


SLOW = ModelSpec(name="slow", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64, max_new_tokens=128,
                 max_running=4, step_ms=50.0).validate()


async def submitted(client: httpx.AsyncClient, new: int, timeout_s: float, priority: str = "interactive"):
    return await client.post("/v1/models/slow/requests", json={
        "input": {"input_ids": [65, 66]}, "params": {"max_new_tokens": new}, "timeout_s": timeout_s,
        "priority": priority})


def published(gw, running: int, waiting: int = 0):
    """Whether the worker's published figures (every 0.5 s, read at most every 0.25 s) show `running` rows and
    `waiting` requests held: a condition for `wait_until`."""
    async def check() -> bool:
        _, stats = await gw.service.load("slow", "short")
        lanes = [ln for s in stats for ln in s.lanes]
        return (sum(ln.running for ln in lanes), sum(ln.waiting for ln in lanes)) == (running, waiting) and \
            all(s.decode_ms_per_step for s in stats)
    return check


async def test_admission_places_a_request_where_the_worker_starts_it(redis_url, prefix):
    """Every row busy for seconds and nothing waiting: a request whose deadline comes before any row ends is refused
    at submit (it was admitted with no wait, then expired in the queue: an outside probe, 6 of 6); one due after the
    first row ends is admitted and served. A request due sooner than a flood of waiting requests is placed before
    them, as the worker starts it (it was refused behind all of them: an outside probe)."""
    settings = make_settings(redis_url, prefix, models=(SLOW,))
    async with running_worker(settings, {}), running_gateway(settings) as gw:
        warm = await asyncio.gather(*(submitted(gw.client, 4, 30) for _ in range(4)))
        for r in warm:
            assert (await gw.client.get(f"/v1/requests/{r.json()['id']}", params={"wait": 10})).json()[
                "status"] == "succeeded"
        busy = await asyncio.gather(*(submitted(gw.client, 100, 60) for _ in range(4)))  # 4 rows for 5 s
        assert all(r.status_code == 202 for r in busy)
        await wait_until(published(gw, running=4))
        refused = await submitted(gw.client, 20, 2.5)  # 1 s of compute, but no row before ~4 s
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "deadline_infeasible", refused.text
        flood = await asyncio.gather(*(submitted(gw.client, 60, 60) for _ in range(8)))  # waiting, due in 60 s
        assert all(r.status_code == 202 for r in flood)
        await wait_until(published(gw, running=4, waiting=8))  # the worker holds them, its figures say so
        urgent = await submitted(gw.client, 10, 5.5)  # 0.5 s of compute after a row ends, before the flood
        assert urgent.status_code == 202, urgent.text
        done = (await gw.client.get(f"/v1/requests/{urgent.json()['id']}", params={"wait": 15})).json()
        assert done["status"] == "succeeded" and done["finished_at"] <= done["deadline"], done
        for r in [*busy, *flood]:
            await gw.client.delete(f"/v1/requests/{r.json()['id']}")
