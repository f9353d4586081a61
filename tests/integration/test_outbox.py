"""Webhooks queued through the record's outbox (`shared.records`): a state change and its webhook are one
script on the record's slot; the move to the callback stream (another Redis Cluster slot) comes after, and
what a writer that died in between left behind is swept before the request's stream entry is acked. Each
delivery reaches the dispatcher's schedule once."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from gpu_worker.outcomes import result_for
from gpu_worker.redis_queue import RedisQueue
from gpu_worker.work_queue import Finished, Held
from shared.callback_store import CallbackStore
from shared.codec import decode
from shared.keys import Keys
from shared.messages import Callback, CallbackDelivery
from shared.records import FINISH_LUA, RecordStore, completed_delivery
from shared.redis_io import make_redis
from shared.states import FinishReason, Status
from tests.fakes import make_request

pytestmark = pytest.mark.redis
NOW = time.time()


@pytest.fixture
async def parts(redis_url, prefix):
    client = make_redis(redis_url)
    keys = Keys(prefix)
    store = RecordStore(client, keys, 60)
    yield client, keys, store, RedisQueue(client, keys, store)
    await client.aclose()


def with_callback(rid: str, events=("started", "completed")):
    return replace(make_request(rid), callback=Callback("https://example.test/hook", events))


async def script_only(client, store, result, meta) -> int:
    """The finish script alone: a writer that dies right after it, before its flush."""
    (won,) = await client.eval(FINISH_LUA, 1, store.keys.record(result.id), *store._finish_args(result, meta))
    return won


async def stream(client, keys) -> list[CallbackDelivery]:
    return [decode(f[b"d"], CallbackDelivery) for _, f in await client.xrange(keys.callback_stream())]


async def outbox(client, keys, rid: str) -> dict[bytes, bytes]:
    raw = await client.hgetall(keys.record(rid))
    return {k: v for k, v in raw.items() if k.startswith(b"ob:")}


async def test_a_finish_queues_its_webhook_and_leaves_no_outbox(parts):
    client, keys, store, _ = parts
    req = with_callback("req_a")
    done = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, reason=FinishReason.LENGTH)
    assert await store.finish(done, req.meta())
    assert [(d.request_id, d.event) for d in await stream(client, keys)] == [("req_a", "completed")]
    assert await outbox(client, keys, "req_a") == {}
    # a second terminal write loses, and queues nothing
    assert not await store.finish(result_for(req, Status.CANCELLED, worker="w", now=NOW), req.meta())
    assert len(await stream(client, keys)) == 1


async def test_start_queues_the_started_webhook_once_per_delivery_id(parts):
    client, keys, store, _ = parts
    req = with_callback("req_s")
    assert await store.start([req], 1000) == [Status.RUNNING]
    assert await outbox(client, keys, "req_s") == {}
    assert await store.start([req], 2000) == [Status.RUNNING]  # a second attempt after a crash
    ids = {d.delivery_id for d in await stream(client, keys)}
    assert ids == {"msg_s_started"}  # moved again maybe, but the same delivery


async def test_a_writer_that_dies_after_the_result_leaves_its_webhook_to_the_sweep_before_the_ack(parts):
    client, keys, store, queue = parts
    req = with_callback("req_d")
    stream_key = keys.lane_stream("m", "short")
    entry = await client.xadd(stream_key, {"x": "1"})
    result = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, reason=FinishReason.LENGTH)
    # the script ran; the writer died before its flush
    assert await script_only(client, store, result, req.meta()) == 1
    assert await stream(client, keys) == []
    assert list(await outbox(client, keys, "req_d")) == [b"ob:completed"]
    # whoever settles the request's entry next (a worker that reclaimed it, finding it terminal) sweeps first
    await queue.ack([Held("m", stream_key, entry, req)])
    moved = await stream(client, keys)
    assert [d.delivery_id for d in moved] == ["msg_d_completed"]
    assert moved[0] == completed_delivery(result, req.meta())
    assert await outbox(client, keys, "req_d") == {}


async def test_a_losing_finish_sweeps_what_the_winner_left(parts):
    client, keys, store, queue = parts
    req = with_callback("req_l")
    cancelled = result_for(req, Status.CANCELLED, worker="gateway", now=NOW)
    assert await script_only(client, store, cancelled, req.meta()) == 1  # the canceller died after it
    done = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, reason=FinishReason.LENGTH)
    await queue.complete([Finished(req, done, None)])
    moved = await stream(client, keys)
    assert len(moved) == 1 and moved[0] == completed_delivery(cancelled, req.meta())
    assert await outbox(client, keys, "req_l") == {}


async def test_a_delivery_moved_twice_is_scheduled_once(parts):
    client, keys, store, _ = parts
    req = with_callback("req_t")
    result = result_for(req, Status.SUCCEEDED, worker="w", now=NOW, reason=FinishReason.LENGTH)
    done = completed_delivery(result, req.meta())
    assert done is not None
    await store.flush([done])
    await store.flush([done])  # a sweep after a flush whose HDEL was lost
    cb = CallbackStore(client, keys)
    await client.xgroup_create(keys.callback_stream(), "dispatchers", id="0")
    for entry_id, fields in await client.xrange(keys.callback_stream()):
        await cb.schedule(entry_id, decode(fields[b"d"], CallbackDelivery), 1000)
    assert await client.zrange(keys.callback_due(), 0, -1) == [b"msg_t_completed"]
