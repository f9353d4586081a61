"""The callers' side of the queue (`shared.queue_client`, `shared.operations`) over fakeredis, in process: what
a submit reads and writes, and a waiting submit's order (subscribe, store, wait)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import types

import fakeredis
import pytest

from shared import operations as ops
from shared import queue_client
from shared.admission import Decision, Estimate
from shared.codec import decode, encode
from shared.config import ModelSpec, Settings
from shared.messages import InferenceRequest, LaneStats, RequestResult
from shared.queue_client import QueueClient
from shared.states import FinishReason, Status, Task

SPEC = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=64).validate()


@pytest.fixture
async def q():
    client = QueueClient(Settings(key_prefix="unit", models=(SPEC,), auth="off").validate(),
                         redis=fakeredis.FakeAsyncRedis())
    await client.start()
    yield client
    await client.close()


def stats(worker: str) -> bytes:
    return encode(LaneStats(model="echo", worker=worker, at_ms=int(time.time() * 1000), max_rows=8, free_rows=8,
                            deadline_aware=True, prefill_fixed_ms=1.0, prefill_ms_per_token=0.0,
                            decode_ms_per_step=1.0))


async def test_admission_reads_the_lane_and_reads_the_workers_figures_at_most_every_cache_period(q, monkeypatch):
    now = [1_000.0]  # the process's monotonic clock, moved by hand: a loaded machine's pauses change nothing here
    monkeypatch.setattr(queue_client, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(queue_client, "STATS_CACHE_S", 0.05)
    monkeypatch.setattr(queue_client, "LANE_LENGTH_CACHE_S", 0.0)  # no store of its own to count on
    key = q.keys.lane_stats("echo")
    await q.redis.hset(key, "w1", stats("w1"))
    queued, found = await q.load("echo", "short")
    assert queued == 0 and [s.worker for s in found] == ["w1"]
    await q.redis.hset(key, "w2", stats("w2"))
    await q.redis.xadd(q.keys.lane_stream("echo", "short"), {"m": b"x"})
    queued, found = await q.load("echo", "short")
    assert queued == 1 and [s.worker for s in found] == ["w1"]  # the length is read, the figures reused
    now[0] += 0.06
    _, found = await q.load("echo", "short")
    assert sorted(s.worker for s in found) == ["w1", "w2"]


async def test_right_after_its_own_store_a_process_counts_on_the_length_it_saw_plus_what_it_admitted(q, monkeypatch):
    """Under load a submit costs one round trip: the lane's length comes back with every store, and a submit
    right after counts on it (plus the requests this process admitted since) instead of reading it again."""
    now = [1_000.0]  # the process's monotonic clock, moved by hand: a loaded machine's pauses change nothing here
    monkeypatch.setattr(queue_client, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(queue_client, "LANE_LENGTH_CACHE_S", 0.2)
    monkeypatch.setattr(queue_client, "ADMITTING_S", 0.2)  # d4 below, admitted and never stored, stops counting too
    await q.redis.hset(q.keys.lane_stats("echo"), "w1", stats("w1"))
    stream = q.keys.lane_stream("echo", "short")
    for _ in range(3):
        await q.redis.xadd(stream, {"m": b"x"})
    body = {"input": {"prompt": "hi"}}
    first = ops._build(q, body, SPEC, "t")
    decision, _ = await q.admit(first, SPEC)
    assert decision.accept and decision.queued == 3  # read: nothing of its own stored yet
    (stored,) = await q.submit_many([(first, decision)])
    assert stored.queue_position == 4
    await q.redis.xadd(stream, {"m": b"another process"})  # not seen while the length it saw is fresh
    reads = []
    real_xlen = q.redis.xlen
    monkeypatch.setattr(q.redis, "xlen", lambda name: reads.append(name) or real_xlen(name))
    second, third = (ops._build(q, body, SPEC, "t") for _ in range(2))
    d2, _ = await q.admit(second, SPEC)
    d3, _ = await q.admit(third, SPEC)
    assert (d2.queued, d3.queued) == (4, 5) and reads == []  # its store's length, plus the one admitted since
    out = await q.submit_many([(second, d2), (third, d3)])
    assert [s.queue_position for s in out] == [6, 7]  # exact: the other process's entry is counted now
    await q.redis.xadd(stream, {"m": b"another process"})
    d4, _ = await q.admit(ops._build(q, body, SPEC, "t"), SPEC)
    assert d4.queued == 7  # fresh: not seen yet
    now[0] += 0.25
    d5, _ = await q.admit(ops._build(q, body, SPEC, "t"), SPEC)
    assert d5.queued == 8  # stale: read again


async def test_a_burst_of_concurrent_submits_counts_each_other_before_any_is_stored(q, monkeypatch):
    """The submits of a burst read the lane's length concurrently, before any of them is stored: each must count the
    ones this process admitted ahead of it (they all read 0, and 10 requests, each 1 s alone and 2 s together, were
    all admitted for 2 s deadlines); once stored, a request counts through the lane's length instead."""
    monkeypatch.setattr(queue_client, "LANE_LENGTH_CACHE_S", 0.0)  # every submit reads the length
    await q.redis.hset(q.keys.lane_stats("echo"), "w1", stats("w1"))
    body = {"input": {"prompt": "hi"}}
    reqs = [ops._build(q, body, SPEC, "t") for _ in range(5)]
    decisions = await asyncio.gather(*(q.admit(r, SPEC) for r in reqs))
    assert sorted(d.queued for d, _ in decisions) == [0, 1, 2, 3, 4]
    await q.submit_many([(r, d) for r, (d, _) in zip(reqs, decisions, strict=True)])
    later, _ = await q.admit(ops._build(q, body, SPEC, "t"), SPEC)
    assert later.queued == 5  # the five stored: counted once, by the lane's length


async def test_queue_positions_are_the_lane_length_after_each_xadd(q):
    body = {"input": {"prompt": "hi"}}
    for _ in range(5):
        await q.redis.xadd(q.keys.lane_stream("echo", "short"), {"m": b"x"})
    first, second, other = (ops._build(q, body, SPEC, "t") for _ in range(3))
    other = dataclasses.replace(other, lane="medium")
    decision = Decision(True, Estimate(0.0, 0.0, "none"), queued=5)
    out = await q.submit_many([(first, decision), (second, decision), (other, Decision(True, decision.estimate))])
    assert [s.queue_position for s in out] == [6, 7, 1]
    assert all(s.created for s in out)
    assert await q.redis.xlen(q.keys.lane_stream("echo", "short")) == 7
    again = await q.submit_many([(first, decision)])  # a retry under the same id: the record was there
    assert not again[0].created


async def test_a_stored_request_carries_the_start_admission_estimated_for_it(q):
    """The worker's scheduler ages a lane by the time its requests wait past this (`Job.due`)."""
    body = {"input": {"prompt": "hi"}}
    estimated, unknown = ops._build(q, body, SPEC, "t"), ops._build(q, body, SPEC, "t")
    await q.submit_many([(estimated, Decision(True, Estimate(12.5, 14.0, "stats"))),
                         (unknown, Decision(True, Estimate(0.0, 0.0, "none")))])
    stored = [decode(f[b"m"], InferenceRequest) for _, f in await q.redis.xrange(q.keys.lane_stream("echo", "short"))]
    assert stored[0].start_eta_ms == estimated.created_ms + 12_500
    assert stored[1].start_eta_ms is None  # no estimate (no worker has reported): it ages from its arrival


async def test_a_waiting_submit_subscribes_before_it_stores_and_gets_its_result(q):
    """A worker that finishes the request the moment it is stored: the waiter was subscribed already, so the
    event reaches it (no read of the record before waiting is needed)."""
    stream = q.keys.lane_stream("echo", "short")

    async def worker() -> None:
        while not await q.redis.xlen(stream):
            await asyncio.sleep(0.001)
        ((_, [(_, fields)]),) = await q.redis.xread({stream: "0"}, count=1)
        req = decode(fields[b"m"], InferenceRequest)
        assert q.hub.waiting == 1  # subscribed before the request could be read
        await q.store.finish(RequestResult(id=req.id, status=Status.SUCCEEDED, output={"text": "hihi"},
                                           finish_reason=FinishReason.LENGTH, finished_ms=int(time.time() * 1000),
                                           worker="w"), req.meta())

    task = asyncio.create_task(worker())
    answer = await ops.submit(q, {"input": {"prompt": "hi"}}, SPEC, "t", wait=5.0)
    await task
    assert answer.status == 200 and answer.body["status"] == "succeeded" and answer.body["output"]["text"] == "hihi"
    assert q.hub.waiting == 0


async def test_after_a_refusal_for_its_deadline_no_larger_request_is_admitted_near_the_line_for_a_while(monkeypatch):
    """`admission.CONSISTENT_S`: a refusal for the deadline keeps the same answer, for a request no smaller and with
    no more time, while its estimate stays near the line: the queue moving by a second does not flip it."""
    from shared import admission
    from tests.fakes import ManualClock

    clock = ManualClock(1_000.0)
    q = QueueClient(Settings(key_prefix="unit", models=(SPEC,), auth="off").validate(),
                    redis=fakeredis.FakeAsyncRedis(), clock=clock)
    estimates: list[Estimate] = []
    monkeypatch.setattr(admission, "estimate", lambda *a, **k: estimates.pop(0))

    async def admit(est: Estimate, timeout_s: float = 60) -> Decision:
        estimates.append(est)
        req = ops._build(q, {"input": {"prompt": "hi"}, "timeout_s": timeout_s}, SPEC, "t")
        decision, _ = await q.admit(req, SPEC)
        return decision

    try:
        assert not (await admit(Estimate(42.0, 54.0, "stats"))).accept  # 54 x 1.15 > 60: refused
        clock.advance(1.0)
        near = await admit(Estimate(37.2, 49.2, "stats"))  # inside the margin now, but near the line (x 1.3 > 60)
        assert not near.accept and "refused within the last" in near.reason
        assert (await admit(Estimate(37.2, 49.2, "stats"), timeout_s=120)).accept  # more time: another request
        assert (await admit(Estimate(18.0, 36.0, "stats"))).accept  # far from the line
        clock.advance(admission.CONSISTENT_S + 0.5)  # both refusals (the second is noted too) have left the window
        assert (await admit(Estimate(37.2, 49.2, "stats"))).accept
        # with a short deadline a refusal holds for 5% of it: the queue turns over faster than the window
        assert not (await admit(Estimate(5.0, 9.0, "stats"), timeout_s=10)).accept
        clock.advance(0.6)
        assert (await admit(Estimate(4.0, 8.0, "stats"), timeout_s=10)).accept
    finally:
        await q.close()


async def test_admissions_inside_the_margin_keep_the_inner_margin_however_long_they_chain(monkeypatch):
    """`admission.CONSISTENT_S`: right after a larger request was admitted, a smaller one that meets its deadline
    with the inner margin only is admitted too, and counts as an admission in turn (the line stays where the last
    admissions put it); however long such a chain runs, a request past the inner margin is refused."""
    from shared import admission
    from tests.fakes import ManualClock

    clock = ManualClock(1_000.0)
    q = QueueClient(Settings(key_prefix="unit", models=(SPEC,), auth="off").validate(),
                    redis=fakeredis.FakeAsyncRedis(), clock=clock)
    estimates: list[Estimate] = []
    monkeypatch.setattr(admission, "estimate", lambda *a, **k: estimates.pop(0))

    async def admit(est: Estimate) -> Decision:
        estimates.append(est)
        req = ops._build(q, {"input": {"prompt": "hi"}, "timeout_s": 10}, SPEC, "t")  # deadline 10 s away
        decision, _ = await q.admit(req, SPEC)
        return decision

    try:
        assert (await admit(Estimate(1.0, 6.0, "stats"))).accept  # 5 s of compute, well inside the margin
        clock.advance(1.0)
        tight = await admit(Estimate(6.0, 8.8, "stats"))  # 2.8 s: meets the deadline with 5%, not with 15%
        assert tight.accept and tight.within_margin
        clock.advance(admission.CONSISTENT_S)  # the first admission has left the window; the tight one has not
        again = await admit(Estimate(6.0, 8.8, "stats"))
        assert again.accept and again.within_margin
        past = await admit(Estimate(7.0, 9.6, "stats"))  # 9.6 x 1.05 > 10: past the inner margin, chain or not
        assert not past.accept and past.code == "deadline_infeasible"
    finally:
        await q.close()


@pytest.mark.parametrize("failure", ["connection", "subscription"])
async def test_a_stored_request_whose_wait_loses_redis_is_answered_202_not_503(q, monkeypatch, failure):
    """Stored, then Redis went away while the caller waited (a restart): the request is accepted and will run, so
    the caller gets 202 with its id; a 503 "retry" had a caller without an Idempotency-Key submit it again, computed
    and billed twice, with two webhooks (a user's probe). Before the store, the same failure is still a 503."""
    import redis

    from shared.waiters import SubscriptionUnavailable

    async def lost(*args, **kwargs):
        raise redis.ConnectionError("Connection closed by server.") if failure == "connection" \
            else SubscriptionUnavailable("Connection closed by server.")

    monkeypatch.setattr(q, "wait_on", lost)
    answer = await ops.submit(q, {"input": {"prompt": "hi"}}, SPEC, "t", wait=5.0)
    assert answer.status == 202 and answer.body["id"].startswith("req_")
    assert (await q.get(answer.body["id"])) is not None  # stored: it runs
    monkeypatch.setattr(q, "submit", lost)  # the store itself fails: nothing accepted
    with pytest.raises((redis.ConnectionError, SubscriptionUnavailable)):
        await ops.submit(q, {"input": {"prompt": "hi"}}, SPEC, "t", wait=5.0)


async def test_a_burst_after_a_quiet_spell_is_decided_on_fresh_figures(q, monkeypatch):
    """The figures cached at the last submit, 7 s ago, are too old to decide on: the submits arriving while one reads
    them again read too (they used the old ones, which admission drops as stale, and admitted every request of the
    burst without an estimate)."""
    monkeypatch.setattr(queue_client, "LANE_LENGTH_CACHE_S", 0.0)
    key = q.keys.lane_stats("echo")
    await q.redis.hset(key, "w1", stats("w1"))
    _, found = await q.load("echo", "short")
    assert [s.worker for s in found] == ["w1"]
    later = time.time() + 7
    monkeypatch.setattr(q, "clock", lambda: later)
    monkeypatch.setattr(queue_client.time, "monotonic", lambda real=time.monotonic: real() + 7)
    await q.redis.hset(key, "w1", encode(dataclasses.replace(decode(stats("w1"), LaneStats),
                                                             at_ms=int(later * 1000))))
    burst = await asyncio.gather(*(q.load("echo", "short") for _ in range(5)))
    assert all([s.worker for s in found] == ["w1"] for _, found in burst), burst
