"""A worker that died holding entries (its read-ahead and its running rows): another worker takes them once the
dead one's liveness mark expires (`Announcer.departed`, `gpu_worker.upkeep`), rather than after `reclaim_idle_s`,
on Redis. Here the reclaim idle time is 10 minutes, so only the departed-worker path can finish the requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import pytest

from gpu_worker.announce import ALIVE_S, RedisAnnouncer
from gpu_worker.work_queue import QueueUnavailable
from shared.codec import decode
from shared.config import ModelSpec
from shared.keys import GROUP, Keys
from shared.messages import InferenceRequest
from shared.records import RecordStore
from shared.redis_io import make_redis
from shared.states import Status, Task
from tests.integration.test_stack import wait_until
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

ECHO = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=256,
                 max_new_tokens=128, max_running=4).validate()
BODY = {"input": {"input_ids": [65] * 8}, "params": {"max_new_tokens": 4}, "timeout_s": 60}


async def test_a_workers_liveness_mark_says_when_it_departed(aioredis_client, prefix):
    keys = Keys(prefix)
    announcer = RedisAnnouncer(aioredis_client, keys)
    for worker in ("live", "dead"):
        await announcer.heartbeat(worker, {"instance": worker, "at": time.time()})
    # a worker of an older version announces itself without a liveness mark: never judged departed by its absence
    await aioredis_client.hset(keys.workers(), "older", json.dumps({"instance": "o", "at": time.time()}))
    assert await announcer.departed(["live", "dead", "older", "never-heard"]) == {"never-heard"}
    assert 0 < await aioredis_client.pttl(keys.alive("live")) <= ALIVE_S * 1000
    await aioredis_client.pexpire(keys.alive("dead"), 1)  # as when its last heartbeat is ALIVE_S old
    await wait_until(lambda: _gone(aioredis_client, keys.alive("dead")))
    assert await announcer.departed(["live", "dead", "older"]) == {"dead"}
    await announcer.withdraw("live", {})  # a worker that left (drained): nothing of its stays
    assert await announcer.departed(["live"]) == {"live"} and await announcer.departed([]) == set()
    unreachable = make_redis("redis://127.0.0.1:1/0", retries=0)  # nothing listens on port 1
    with pytest.raises(QueueUnavailable):  # not "none departed": marks expire while Redis is gone, the caller waits
        await RedisAnnouncer(unreachable, keys).departed(["live"])
    await unreachable.aclose()


def _ids(read) -> list[str]:
    return [decode(fields[b"m"], InferenceRequest).id for _, entries in read for _, fields in entries]


async def _gone(client, key: str) -> bool:
    return await client.exists(key) == 0


async def test_a_dead_workers_entries_go_to_a_live_worker_well_before_the_reclaim_idle_time(
        redis_url, prefix, aioredis_client):
    s = make_settings(redis_url, prefix, models=(ECHO,), reclaim_idle_s=600.0)
    keys = Keys(prefix)
    streams = keys.lane_streams("echo", list(ECHO.lane_names))
    async with running_gateway(s) as gw:
        sent = [await gw.client.post("/v1/models/echo/requests", json=BODY) for _ in range(6)]
        assert [r.status_code for r in sent] == [202] * 6
        for stream in streams:
            await aioredis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        # two workers read them and died: one of this version (its mark expired), one older (no mark: left alone)
        await RedisAnnouncer(aioredis_client, keys).heartbeat("dead", {"instance": "d", "at": time.time()})
        await aioredis_client.delete(keys.alive("dead"))
        await aioredis_client.hset(keys.workers(), "older", json.dumps({"instance": "o", "at": time.time()}))
        dead = _ids(await aioredis_client.xreadgroup(GROUP, "dead", {st: ">" for st in streams}, count=4))
        older = _ids(await aioredis_client.xreadgroup(GROUP, "older", {st: ">" for st in streams}, count=2))
        assert len(dead) == 4 and len(older) == 2
        t0 = time.monotonic()
        async with running_worker(dataclasses.replace(s, worker_name=f"{s.worker_name}-b"), {}):
            views = await asyncio.gather(*(gw.client.get(f"/v1/requests/{rid}", params={"wait": 30}) for rid in dead))
            took = time.monotonic() - t0
            views += [await gw.client.get(f"/v1/requests/{rid}") for rid in older]
            pending = {st: await aioredis_client.xpending_range(st, GROUP, "-", "+", 10, consumername="older")
                       for st in streams}
    # the dead worker's, within seconds (idle DEPARTED_IDLE_S, then the next beat); the older worker's stay queued
    assert [v.json()["status"] for v in views] == ["succeeded"] * 4 + ["queued"] * 2 and took < 30, (views, took)
    assert sum(len(p) for p in pending.values()) == 2  # ... until the reclaim idle time
    store = RecordStore(aioredis_client, keys, 60)
    for rid in dead:
        rec = await store.get(rid)
        assert rec is not None and rec.state is Status.SUCCEEDED and rec.attempts == 1
