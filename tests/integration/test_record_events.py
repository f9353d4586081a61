"""The done event carries the terminal record (`shared.records.FINISH_LUA`), so a waiter answers without reading
the record back; the record it carries equals the one stored, field for field. Against the real Redis (or
cluster) of the run."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from gpu_worker.outcomes import result_for
from shared.keys import Keys
from shared.messages import Callback
from shared.records import RECORD_EVENT, RECORD_EVENT_MAX_BYTES, RecordStore, record_from_event
from shared.redis_io import make_redis, pubsub_of
from shared.states import FinishReason, Status
from tests.fakes import make_request

pytestmark = pytest.mark.redis
NOW = time.time()


@pytest.fixture
async def parts(redis_url, prefix):
    client = make_redis(redis_url)
    yield client, Keys(prefix), RecordStore(client, Keys(prefix), 60)
    await client.aclose()


async def finish_and_hear(client, keys, store, req, result, *, start: bool = True) -> bytes:
    """Finish `req` (after queueing and starting it) while subscribed to its done channel; the event's data."""
    pipe = client.pipeline(transaction=False)
    await store.init_in(pipe, req, int(NOW * 1000))
    await pipe.execute()
    if start:
        await store.start([req], int(NOW * 1000) + 5)
    sub = await pubsub_of(client)
    try:
        await sub.subscribe(keys.done_channel(req.id))
        assert (await sub.get_message(timeout=2.0))["type"] == "subscribe"
        assert await store.finish(result, req.meta())
        msg = None
        for _ in range(50):
            msg = await sub.get_message(timeout=0.1)
            if msg is not None and msg["type"] == "message":
                break
        assert msg is not None and msg["type"] == "message"
        return msg["data"]
    finally:
        await sub.aclose()


@pytest.mark.parametrize("start", [True, False])
async def test_the_done_event_carries_the_stored_record(parts, start):
    client, keys, store = parts
    req = replace(make_request("req_ev1" if start else "req_ev2"),
                  callback=Callback("https://example.test/hook", ("completed",)))
    result = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, output={"text": "héllo:-1:\x00"},
                        reason=FinishReason.LENGTH)
    data = await finish_and_hear(client, keys, store, req, result, start=start)
    assert data[:1] == RECORD_EVENT
    carried = record_from_event(req.id, data[1:])
    stored = await store.get(req.id)
    assert carried is not None and stored is not None
    assert carried == stored  # state, meta, result, started, attempts, callback state
    assert carried.result == result and (carried.started_ms is not None) is start
    assert carried.attempts == (1 if start else 0)


async def test_a_large_result_is_read_from_the_record_instead(parts):
    client, keys, store = parts
    req = make_request("req_ev3")
    result = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, output={"text": "x" * RECORD_EVENT_MAX_BYTES},
                        reason=FinishReason.LENGTH)
    data = await finish_and_hear(client, keys, store, req, result)
    assert data == Status.SUCCEEDED.value.encode()  # the state alone: the waiter reads the record


@pytest.mark.parametrize("payload", [b"", b"9:succeeded", b"-", b"x:y", b"9:succeeded-", b"9:succeeded------x"])
def test_a_malformed_event_is_no_record(payload):
    assert record_from_event("req_x", payload) is None


async def test_a_waiter_answers_from_the_event_without_reading_the_record(redis_url, prefix, monkeypatch):
    """The gateway's wait: woken by the event, it parses the record from it; it reads the record only once,
    before it waits (the read that closes the race with a result written before the subscription)."""
    from tests.stack import make_settings, running_gateway

    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:
        q = gw.service
        req = make_request("req_ev4")
        pipe = q.redis.pipeline(transaction=False)
        await q.store.init_in(pipe, req, int(time.time() * 1000))
        await pipe.execute()
        reads = []
        real_get = q.store.get

        async def counting_get(rid):
            reads.append(rid)
            return await real_get(rid)

        monkeypatch.setattr(q.store, "get", counting_get)
        waiter = asyncio.create_task(q.wait(req.id, 10.0))
        await asyncio.sleep(0.3)
        before = len(reads)
        done = result_for(req, Status.SUCCEEDED, worker="w", now=time.time(), output={"text": "ok"},
                          reason=FinishReason.LENGTH)
        assert await q.store.finish(done, req.meta())
        rec = await asyncio.wait_for(waiter, 5.0)
        assert rec is not None and rec.state is Status.SUCCEEDED and rec.result == done
        assert len(reads) == before  # no read after the event


async def test_a_record_an_interrupted_submit_left_without_meta_or_ttl_gets_them_from_the_worker(parts):
    """The queued record is three plain commands (state and meta if absent, then the TTL); a pipeline cut after the
    first leaves a bare state. The worker's start writes the meta where it is missing, its finish the TTL."""
    client, keys, store = parts
    req = make_request("req_ev5")
    await client.hsetnx(keys.record(req.id), "state", Status.QUEUED.value)
    assert await client.pttl(keys.record(req.id)) == -1
    assert await store.start([req], int(NOW * 1000)) == [Status.RUNNING]
    rec = await store.get(req.id)
    assert rec is not None and rec.meta == req.meta() and rec.attempts == 1
    done = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, output={"text": "ok"}, reason=FinishReason.LENGTH)
    assert await store.finish(done, req.meta())
    assert 0 < await client.pttl(keys.record(req.id)) <= 60_000


async def test_the_queued_record_never_overwrites_what_a_worker_wrote_first(parts):
    """On a cluster the stream and the record are on different nodes: a worker can start or even finish a request
    before its queued record lands. The late queued record changes neither state nor meta, and says it created
    nothing."""
    client, _keys, store = parts
    req = make_request("req_ev6")
    assert await store.start([req], int(NOW * 1000)) == [Status.RUNNING]
    pipe = client.pipeline(transaction=False)
    await store.init_in(pipe, req, int(NOW * 1000))
    created, _, _ = await pipe.execute()
    rec = await store.get(req.id)
    assert created == 0 and rec is not None and rec.state is Status.RUNNING and rec.started_ms is not None
