"""Stream ownership against a real Redis: renewal keeps entries, reclaim takes idle ones, clean-up."""

from __future__ import annotations

import asyncio

import pytest

from gpu_worker import leases
from shared.keys import GROUP, Keys

pytestmark = [pytest.mark.redis]


async def setup_stream(r, prefix: str, n: int) -> str:
    stream = Keys(prefix).lane_stream("m", "short")
    await r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(n):
        await r.xadd(stream, {"m": f"x{i}"})
    return stream


async def test_renewal_keeps_entries_and_reclaim_takes_idle_ones(aioredis_client, prefix):
    r = aioredis_client
    stream = await setup_stream(r, prefix, 4)
    got = await r.xreadgroup(GROUP, "alive", {stream: ">"}, count=2)
    mine = [eid for eid, _ in got[0][1]]
    await r.xreadgroup(GROUP, "dead", {stream: ">"}, count=2)
    await asyncio.sleep(0.3)
    assert await leases.renew(r, "alive", {stream: mine}) == 2
    claimed = await leases.reclaim(r, stream, "rescuer", 200, 10)
    assert {c.deliveries for c in claimed} == {2} and len(claimed) == 2  # the dead one's, counted twice
    assert not {c.entry_id for c in claimed} & set(mine)  # the renewed ones stay with their live owner


async def test_renewal_does_not_steal_back_a_reclaimed_entry(aioredis_client, prefix):
    r = aioredis_client
    stream = await setup_stream(r, prefix, 1)
    got = await r.xreadgroup(GROUP, "paused", {stream: ">"}, count=1)
    (eid,) = [e for e, _ in got[0][1]]
    await asyncio.sleep(0.25)
    assert len(await leases.reclaim(r, stream, "rescuer", 200, 10)) == 1
    assert await leases.renew(r, "paused", {stream: [eid]}) == 0
    assert list(await leases.pending_of(r, stream, "rescuer", 10)) == [eid]


async def test_departed_consumers_are_cleaned_once_they_own_nothing(aioredis_client, prefix):
    r = aioredis_client
    stream = await setup_stream(r, prefix, 1)
    await r.xreadgroup(GROUP, "owner", {stream: ">"}, count=1)
    await r.xgroup_createconsumer(stream, GROUP, "idle-empty")  # a departed worker that owns nothing
    await asyncio.sleep(0.2)
    assert await leases.clean_consumers(r, [stream], keep="me", idle_ms=100) == 1
    names = {c["name"].decode() for c in await r.xinfo_consumers(stream, GROUP)}
    assert names == {"owner"}  # still owns an entry: kept
    await leases.leave(r, [stream], "owner")
    assert {c["name"].decode() for c in await r.xinfo_consumers(stream, GROUP)} == {"owner"}
