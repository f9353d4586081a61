"""The queue port's contract (`gpu_worker.work_queue`), run against every implementation: the in-memory
queue (its clock moved by hand), the Redis adapter over fakeredis (in process) and over a real Redis (own
key prefix, marked `redis`)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from gpu_worker.memory_queue import MemoryQueue
from gpu_worker.outcomes import failed_outcome, result_for
from gpu_worker.work_queue import DeadLetter, Entry, Finished, Held, QueueUnavailable, WorkQueue, decode_request
from shared.keys import Keys
from shared.messages import StreamDelta
from shared.states import FinishReason, Status
from tests.fakes import ManualClock, make_request


@dataclass
class Backend:
    queue: WorkQueue
    keys: Keys
    elapse: Callable[[float], Awaitable[None]]  # let idle time pass
    add_raw: Callable[[str, dict[bytes, bytes]], Awaitable[bytes]]
    entries: Callable[[str], Awaitable[dict[bytes, dict[bytes, bytes]]]]
    state: Callable[[str], Awaitable[tuple[Status | None, int]]]  # a record's state and attempts
    drop_stream: Callable[[str], Awaitable[None]]  # as a Redis restarted empty would
    unavailable: Callable[[], WorkQueue]

    @property
    def stream(self) -> str:
        return self.keys.lane_stream("m", "short")


async def memory_backend() -> Backend:
    clock = ManualClock()
    q = MemoryQueue(clock)

    async def elapse(s: float) -> None:
        clock.advance(s)

    async def add_raw(stream: str, fields: dict[bytes, bytes]) -> bytes:
        return q.add(stream, fields)

    async def entries(stream: str) -> dict[bytes, dict[bytes, bytes]]:
        return q.entries(stream)

    async def state(rid: str) -> tuple[Status | None, int]:
        rec = q.records.get(rid)
        return (rec.state, rec.attempts) if rec else (None, 0)

    async def drop_stream(stream: str) -> None:
        q.streams.pop(stream, None)

    def unavailable() -> WorkQueue:
        off = MemoryQueue(clock)
        off.available = False
        return off

    return Backend(q, Keys("mem"), elapse, add_raw, entries, state, drop_stream, unavailable)


async def redis_backend(client: Any, prefix: str) -> Backend:
    from gpu_worker.redis_queue import RedisQueue
    from shared.records import RecordStore
    from shared.redis_io import make_redis

    keys = Keys(prefix)
    q = RedisQueue(client, keys, RecordStore(client, keys, 60))

    async def add_raw(stream: str, fields: dict[bytes, bytes]) -> bytes:
        return await client.xadd(stream, fields)

    async def entries(stream: str) -> dict[bytes, dict[bytes, bytes]]:
        return dict(await client.xrange(stream))

    async def state(rid: str) -> tuple[Status | None, int]:
        rec = await q.store.get(rid)
        return (rec.state, rec.attempts) if rec else (None, 0)

    async def drop_stream(stream: str) -> None:
        await client.delete(stream)

    def unavailable() -> WorkQueue:
        dead = make_redis("redis://127.0.0.1:1/0", retries=0)  # nothing listens on port 1
        return RedisQueue(dead, keys, RecordStore(dead, keys, 60))

    return Backend(q, keys, asyncio.sleep, add_raw, entries, state, drop_stream, unavailable)


@pytest.fixture(params=["memory", "fakeredis", pytest.param("redis", marks=pytest.mark.redis)])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """The in-memory queue; the Redis adapter over fakeredis (in process: its quirks, no server); over Redis."""
    if request.param in ("memory", "fakeredis"):
        if request.param == "memory":
            b = await memory_backend()
        else:
            import fakeredis

            b = await redis_backend(fakeredis.FakeAsyncRedis(), "fake")
        await b.queue.create_groups([b.stream])
        yield b
        return
    from shared.redis_io import make_redis

    prefix = request.getfixturevalue("prefix")  # this test's keys, deleted afterwards
    client = make_redis(request.getfixturevalue("redis_url"))
    b = await redis_backend(client, prefix)
    await b.queue.create_groups([b.stream])
    yield b
    await client.aclose()


async def setup_stream(b: Backend, n: int) -> list[bytes]:
    return [await b.queue.enqueue(b.stream, make_request(f"r{i}")) for i in range(n)]


def held(b: Backend, e: Entry) -> Held:
    return Held("m", e.stream, e.id, decode_request(e))


def succeeded(h: Held) -> Finished:
    return Finished(h.request, result_for(h.request, Status.SUCCEEDED, worker="w", now=time.time(),
                                          output={"text": "ok"}, reason=FinishReason.LENGTH), h)


def test_every_implementation_offers_the_ports_operations():
    from gpu_worker.redis_queue import RedisQueue

    ops = {name: inspect.signature(op) for name, op in vars(WorkQueue).items()
           if inspect.iscoroutinefunction(op) and not name.startswith("_")}
    assert len(ops) == 16
    for impl in (MemoryQueue, RedisQueue):
        for name, sig in ops.items():
            assert inspect.signature(getattr(impl, name)).parameters.keys() == sig.parameters.keys(), (impl, name)


# --- reading ---------------------------------------------------------------------------------------------
async def test_read_delivers_each_entry_once_up_to_count(backend):
    b = backend
    ids = await setup_stream(b, 3)
    first = await b.queue.read("a", [b.stream], 2, 0)
    assert [e.id for e in first] == ids[:2] and {e.deliveries for e in first} == {1}
    rest = await b.queue.read("b", [b.stream], 10, 0)
    assert [e.id for e in rest] == ids[2:]
    assert await b.queue.read("a", [b.stream], 10, 0) == []
    assert await b.queue.pending(b.stream, "a", 10) == {ids[0]: 1, ids[1]: 1}
    assert await b.queue.consumers(b.stream) == {"a": 2, "b": 1}


async def test_read_blocks_until_an_entry_arrives_or_the_timeout(backend):
    b = backend
    t0 = time.monotonic()
    assert await b.queue.read("a", [b.stream], 10, 0.15) == []
    assert time.monotonic() - t0 >= 0.1
    later = asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(setup_stream(b, 1)))
    t0 = time.monotonic()
    got = await b.queue.read("a", [b.stream], 10, 2.0)
    later.cancel()
    assert len(got) == 1 and time.monotonic() - t0 < 1.0  # woken by the entry, not by the timeout


async def test_a_blocking_read_returns_the_entries_already_there_at_once(backend):
    b = backend
    ids = await setup_stream(b, 2)
    t0 = time.monotonic()
    got = await b.queue.read("a", [b.stream], 10, 1.0)
    assert [e.id for e in got] == ids and time.monotonic() - t0 < 0.5
    assert await b.queue.pending(b.stream, "a", 10) == {i: 1 for i in ids}


async def test_a_vanished_group_is_recreated_by_read(backend):
    b = backend
    await b.drop_stream(b.stream)
    assert await b.queue.read("a", [b.stream], 10, 0) == []
    ids = await setup_stream(b, 1)
    assert [e.id for e in await b.queue.read("a", [b.stream], 10, 0)] == ids
    assert await b.queue.reclaim("a", "no-such-stream", 0, 10) == []


# --- ownership: renew, reclaim, clean up ------------------------------------------------------------------
async def test_renewal_keeps_entries_and_reclaim_takes_idle_ones(backend):
    b = backend
    await setup_stream(b, 4)
    mine = [e.id for e in await b.queue.read("alive", [b.stream], 2, 0)]
    await b.queue.read("dead", [b.stream], 2, 0)
    await b.elapse(0.3)
    assert await b.queue.renew("alive", {b.stream: mine}) == 2
    claimed = await b.queue.reclaim("rescuer", b.stream, 0.2, 10)
    assert {c.deliveries for c in claimed} == {2} and len(claimed) == 2  # the dead one's, counted twice
    assert not {c.id for c in claimed} & set(mine)  # the renewed ones stay with their live owner
    assert all(c.fields for c in claimed)


async def test_each_reclaim_counts_a_delivery(backend):
    b = backend
    await setup_stream(b, 1)
    await b.queue.read("w1", [b.stream], 1, 0)
    for n, consumer in ((2, "w2"), (3, "w3")):
        await b.elapse(0.5)
        (c,) = await b.queue.reclaim(consumer, b.stream, 0.2, 10)
        assert c.deliveries == n
    # just claimed: not idle (unclaimed since the read it would have been idle 1 s; margin for a slow machine)
    assert await b.queue.reclaim("w4", b.stream, 0.8, 10) == []


async def test_reclaim_of_one_owner_takes_only_its_idle_entries_in_order(backend):
    b = backend
    await setup_stream(b, 5)
    gone = [e.id for e in await b.queue.read("gone", [b.stream], 3, 0)]
    other = [e.id for e in await b.queue.read("other", [b.stream], 2, 0)]
    assert await b.queue.reclaim("me", b.stream, 0.2, 10, owner="gone") == []  # not idle yet
    await b.elapse(0.3)
    await b.queue.renew("gone", {b.stream: gone[2:]})  # renewed just now: not idle
    claimed = await b.queue.reclaim("me", b.stream, 0.2, 10, owner="gone")
    assert [c.id for c in claimed] == gone[:2] and {c.deliveries for c in claimed} == {2}
    assert all(c.fields for c in claimed)
    assert list(await b.queue.pending(b.stream, "other", 10)) == other  # idle, but another owner's: left alone
    assert list(await b.queue.pending(b.stream, "gone", 10)) == gone[2:]
    assert await b.queue.reclaim("me", b.stream, 0.2, 10, owner="me") == []  # just claimed: not idle
    await b.elapse(0.3)
    (c,) = await b.queue.reclaim("me", b.stream, 0.2, 1, owner="me")  # its own, up to `count`
    assert c.id == gone[0] and c.deliveries == 3
    assert await b.queue.reclaim("me", "no-such-stream", 0, 10, owner="gone") == []


async def test_renewal_does_not_steal_back_a_reclaimed_entry(backend):
    b = backend
    await setup_stream(b, 1)
    (eid,) = [e.id for e in await b.queue.read("paused", [b.stream], 1, 0)]
    await b.elapse(0.25)
    assert len(await b.queue.reclaim("rescuer", b.stream, 0.2, 10)) == 1
    assert await b.queue.renew("paused", {b.stream: [eid]}) == 0
    assert list(await b.queue.pending(b.stream, "rescuer", 10)) == [eid]


async def test_departed_consumers_are_cleaned_once_they_own_nothing(backend):
    b = backend
    await setup_stream(b, 2)
    await b.queue.read("owner", [b.stream], 1, 0)
    (e,) = await b.queue.read("idle-empty", [b.stream], 1, 0)  # a departed worker that owns nothing
    await b.queue.ack([held(b, e)])
    await b.elapse(0.2)
    assert await b.queue.clean_departed([b.stream], keep="me", idle_s=0.1) == 1
    assert set(await b.queue.consumers(b.stream)) == {"owner"}  # still owns an entry: kept
    await b.queue.leave("owner", [b.stream])
    assert set(await b.queue.consumers(b.stream)) == {"owner"}
    await setup_stream(b, 1)
    (e,) = await b.queue.read("gone", [b.stream], 1, 0)
    await b.queue.ack([held(b, e)])
    assert set(await b.queue.consumers(b.stream)) == {"owner", "gone"}
    await b.queue.leave("gone", [b.stream])  # owns nothing any more: deleted
    assert set(await b.queue.consumers(b.stream)) == {"owner"}


# --- settling entries --------------------------------------------------------------------------------------
async def test_complete_writes_the_record_then_acks_and_the_first_terminal_write_wins(backend):
    b = backend
    await setup_stream(b, 2)
    entries = await b.queue.read("w", [b.stream], 10, 0)
    h0, h1 = (held(b, e) for e in entries)
    assert await b.queue.mark_running([h0.request, h1.request], 1) == [True, True]
    await b.queue.complete([succeeded(h0)])
    assert await b.state("r0") == (Status.SUCCEEDED, 1)
    assert await b.queue.pending(b.stream, "w", 10) == {h1.entry_id: 1}
    assert list(await b.entries(b.stream)) == [h1.entry_id]  # acked entries are deleted
    late = failed_outcome(h0.request, "other", time.time(), "model_error", "too late")
    await b.queue.complete([Finished(h0.request, late.result, None)])
    assert (await b.state("r0"))[0] is Status.SUCCEEDED
    assert await b.queue.mark_running([h0.request, h1.request], 2) == [False, True]  # terminal: not live
    assert await b.state("r1") == (Status.RUNNING, 2)


async def test_ack_and_hand_back(backend):
    b = backend
    await setup_stream(b, 2)
    h0, h1 = (held(b, e) for e in await b.queue.read("w", [b.stream], 10, 0))
    await b.queue.ack([h0])
    assert await b.queue.mark_running([h1.request], 5) == [True]
    await b.queue.hand_back([h1])
    # waiting again, not shown running on a worker that let it go (its start counted)
    assert await b.state("r1") == (Status.QUEUED, 1)
    assert await b.queue.pending(b.stream, "w", 10) == {}
    again = await b.queue.read("other", [b.stream], 10, 0)  # a fresh entry, at once, for another worker
    assert [held(b, e).request.id for e in again] == ["r1"] and again[0].id != h1.entry_id
    assert list(await b.entries(b.stream)) == [again[0].id]


async def test_dead_letter_moves_the_entry_and_fails_its_request(backend):
    b = backend
    await setup_stream(b, 1)
    await b.add_raw(b.stream, {b"m": b"not msgpack"})
    good, bad = await b.queue.read("w", [b.stream], 10, 0)
    h = held(b, good)
    failed = failed_outcome(h.request, "w", time.time(), "poison_request", "dead-lettered")
    dead = b.keys.dead_letter("m")
    await b.queue.dead_letter(dead, [DeadLetter(good, "kept crashing", Finished(h.request, failed.result, None)),
                                     DeadLetter(bad, "undecodable")])
    assert await b.state("r0") == (Status.FAILED, 0)
    assert await b.queue.pending(b.stream, "w", 10) == {} and await b.entries(b.stream) == {}
    letters = list((await b.entries(dead)).values())
    assert [f[b"reason"] for f in letters] == [b"kept crashing", b"undecodable"]
    assert letters[0][b"m"] == good.fields[b"m"] and letters[0][b"stream"] == b.stream.encode()
    assert letters[0][b"deliveries"] == b"1"


async def test_an_unreachable_store_raises_queue_unavailable(backend):
    q = backend.unavailable()
    with pytest.raises(QueueUnavailable):
        await q.read("w", [backend.stream], 1, 0)
    with pytest.raises(QueueUnavailable):
        await q.mark_running([make_request("x")], 1)


async def test_published_deltas_are_what_a_later_attempt_continues_after(backend):
    b = backend
    first = StreamDelta(start=0, token_ids=(5, 6), text="ab")
    await b.queue.publish_deltas([("r0", first, True), ("r1", StreamDelta(0, (9,), "z"), True)])
    await b.queue.publish_deltas([("r0", StreamDelta(start=2, token_ids=(7,), text="c"), False)])
    assert await b.queue.streamed(["r0", "r1", "r2"]) == {"r0": (5, 6, 7), "r1": (9,)}
    assert await b.queue.streamed([]) == {}
