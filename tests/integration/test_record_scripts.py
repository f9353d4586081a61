"""The record scripts write many records in one call (`shared.records.START_LUA`, `FINISH_LUA`): one EVAL for all on
one Redis, one per hash slot on a cluster, each record judged on its own; and a finish near its deadline keeps the
record's TTL instead of setting it again. Against the real Redis (or cluster) of the run."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

import shared.records
from gpu_worker.outcomes import result_for
from shared.keys import Keys
from shared.records import KEEP_TTL_SHARE, RECORD_EVENT, RecordStore, record_from_event
from shared.redis_io import MAX_KEYS_PER_SCRIPT, make_redis, pubsub_of, script_groups
from shared.states import FinishReason, Status
from tests.fakes import make_request

pytestmark = pytest.mark.redis
RESULT_TTL_S = 600


@pytest.fixture
async def parts(redis_url, prefix):
    client = make_redis(redis_url)
    yield client, Keys(prefix), RecordStore(client, Keys(prefix), RESULT_TTL_S)
    await client.aclose()


@pytest.fixture
def evals(monkeypatch) -> list[int]:
    """The number of records of each script call the store queues."""
    calls: list[int] = []
    real = shared.records.in_pipeline

    def counting(pipe, script, keys, args):
        calls.append(len(keys))
        real(pipe, script, keys, args)

    monkeypatch.setattr(shared.records, "in_pipeline", counting)
    return calls


async def queue(client, store, reqs) -> None:
    pipe = client.pipeline(transaction=False)
    for req in reqs:
        await store.init_in(pipe, req, int(time.time() * 1000))
    await pipe.execute()


def done(req, status=Status.SUCCEEDED, **kw):
    return result_for(req, status, worker="w", now=time.time(), output={"text": req.id}, reason=FinishReason.LENGTH,
                      **kw)


def group_sizes(client, keys, rids) -> list[int]:
    return [len(g) for g in script_groups(client, [keys.record(rid) for rid in rids])]


async def test_many_records_start_and_finish_in_one_call_each_judged_on_its_own(parts, evals):
    client, keys, store = parts
    reqs = [make_request(f"req_many{i}") for i in range(5)]
    rids = [r.id for r in reqs]
    await queue(client, store, reqs)
    assert await store.finish(done(reqs[1], Status.CANCELLED), reqs[1].meta())  # cancelled before it started
    evals.clear()
    states = await store.start(reqs, int(time.time() * 1000))
    assert states == [Status.RUNNING, Status.CANCELLED, Status.RUNNING, Status.RUNNING, Status.RUNNING]
    assert await store.finish_all([(done(r), r.meta()) for r in reqs[:4]]) == [True, False, True, True]
    assert await store.finish_all([(done(reqs[4]), reqs[4].meta()), (done(reqs[0]), reqs[0].meta())]) == [True, False]
    # one call per group: all records together on one Redis, one hash slot's on a cluster
    assert evals == (group_sizes(client, keys, rids) + group_sizes(client, keys, rids[:4])
                     + group_sizes(client, keys, [rids[4], rids[0]]))
    if not isinstance(client, RedisCluster):
        assert evals == [5, 4, 2]
    for r in reqs:
        rec = await store.get(r.id)
        assert rec is not None and rec.meta == r.meta()
        if r is reqs[1]:
            assert rec.state is Status.CANCELLED and rec.started_ms is None and rec.attempts == 0
        else:
            assert rec.state is Status.SUCCEEDED and rec.attempts == 1 and rec.started_ms is not None
            assert rec.result is not None and rec.result.output == {"text": r.id}


async def test_each_record_of_a_call_hears_its_own_done_event(parts):
    client, keys, store = parts
    reqs = [make_request(f"req_ev_many{i}") for i in range(3)]
    await queue(client, store, reqs)
    sub = await pubsub_of(client)
    try:
        await sub.subscribe(*(keys.done_channel(r.id) for r in reqs))
        for _ in reqs:
            assert (await sub.get_message(timeout=2.0))["type"] == "subscribe"
        results = [done(r) for r in reqs]
        assert await store.finish_all([(res, r.meta()) for res, r in zip(results, reqs, strict=True)]) == [True] * 3
        heard = {}
        for _ in reqs:
            msg = await sub.get_message(timeout=2.0)
            channel = msg["channel"].decode()
            heard[channel] = record_from_event(channel, msg["data"][len(RECORD_EVENT):])
        for res, r in zip(results, reqs, strict=True):
            rec = heard[keys.done_channel(r.id)]
            assert rec is not None and rec.state is Status.SUCCEEDED and rec.result == res
    finally:
        await sub.aclose()


def test_script_groups_keep_a_cluster_call_within_one_slot_and_bounded():
    keys = Keys("t")
    rids = [f"req_g{i}" for i in range(3 * MAX_KEYS_PER_SCRIPT)]
    single = script_groups(aioredis.Redis(), [keys.record(r) for r in rids])
    assert [len(g) for g in single] == [MAX_KEYS_PER_SCRIPT] * 3
    assert [i for g in single for i in g] == list(range(len(rids)))
    assert script_groups(aioredis.Redis(), []) == []
    cluster = RedisCluster(host="127.0.0.1", port=1)  # not connected: grouping needs only the key slots
    record_keys = [keys.record(r) for r in rids] + [keys.done_channel(rids[0])]
    groups = script_groups(cluster, record_keys)
    assert sorted(i for g in groups for i in g) == list(range(len(record_keys)))
    for g in groups:
        assert len({key_slot(record_keys[i].encode()) for i in g}) == 1 and len(g) <= MAX_KEYS_PER_SCRIPT
    assert [0, len(rids)] in groups  # a record and its own channel share the slot: one group


async def test_a_finish_near_its_deadline_keeps_the_records_ttl(parts):
    """The queued record lives until its deadline plus the result TTL. A finish at most `KEEP_TTL_SHARE` of the result
    TTL before its deadline keeps that (one command less); farther from it, or past it, the TTL is set to the result
    TTL; a record that lacks its meta (a cut submit) is given one either way."""
    client, keys, store = parts
    ttl_ms = RESULT_TTL_S * 1000
    slack_s = RESULT_TTL_S * KEEP_TTL_SHARE
    near = make_request("req_ttl_near", timeout_s=slack_s / 2)
    far = make_request("req_ttl_far", timeout_s=slack_s * 3)
    late = make_request("req_ttl_late", timeout_s=0.001)
    late = replace(late, deadline_ms=late.deadline_ms - 1000)  # its deadline already past at the finish
    bare = make_request("req_ttl_bare", timeout_s=slack_s / 2)
    await queue(client, store, [near, far, late])
    await client.hsetnx(keys.record(bare.id), "state", Status.QUEUED.value)  # a submit's pipeline cut after the state
    assert await store.finish_all([(done(r), r.meta()) for r in (near, far, late, bare)]) == [True] * 4
    assert ttl_ms < await client.pttl(keys.record(near.id)) <= ttl_ms + slack_s * 1000 / 2
    assert ttl_ms - 2000 < await client.pttl(keys.record(far.id)) <= ttl_ms
    assert ttl_ms - 2000 < await client.pttl(keys.record(late.id)) <= ttl_ms
    assert ttl_ms - 2000 < await client.pttl(keys.record(bare.id)) <= ttl_ms


async def test_a_cancel_only_while_queued_never_ends_a_request_a_worker_started(parts):
    """A batch's cancel stops only what no worker has started, in one step with the check (`only_if`): read as
    queued, started by a worker, then cancelled, the request runs on (it was cancelled through its worker and ended
    with no output, neither finished nor `batch_cancelled`); one still queued ends cancelled, and a worker's start
    after that skips it."""
    from shared.ids import new_request_id
    from shared.messages import ErrorInfo

    client, _keys, store = parts
    a, b = make_request(new_request_id()), make_request(new_request_id())
    await queue(client, store, [a, b])
    seen_a, seen_b = await store.get(a.id), await store.get(b.id)
    assert seen_a.state is Status.QUEUED and seen_b.state is Status.QUEUED
    assert await store.start([a], int(time.time() * 1000)) == [Status.RUNNING]  # a worker starts it meanwhile
    why = ErrorInfo("cancelled", "cancelled with its batch before it ran")
    for rec, won in ((seen_a, False), (seen_b, True)):
        assert await store.end_unanswered(rec, Status.CANCELLED, why, int(time.time() * 1000), "gateway",
                                          only_if=Status.QUEUED) is won
    assert (await store.get(a.id)).state is Status.RUNNING
    ended = await store.get(b.id)
    assert ended.state is Status.CANCELLED and ended.result.error.message == why.message
    assert await store.start([b], int(time.time() * 1000)) != [Status.RUNNING]  # never started after it
    assert await store.finish(done(a), a.meta())  # the started one ends as its worker ends it
