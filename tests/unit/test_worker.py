"""The worker's I/O side on the in-memory queue with a fake compute side: no Redis, no torch, milliseconds.

Each test runs a real `Worker` (intake, upkeep, publisher, announcements, drain) against `MemoryQueue`;
`FakeEngines` (tests/fakes.py) stands in for the models."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from gpu_worker import upkeep
from gpu_worker.announce import ALIVE_S, MemoryAnnouncer
from gpu_worker.memory_queue import MemoryQueue
from gpu_worker.outcomes import HandBack, result_for
from gpu_worker.upkeep import DEPARTED_IDLE_S
from gpu_worker.work_queue import Held
from gpu_worker.worker import Worker
from shared.codec import encode
from shared.config import BUILTIN_MODELS, Settings
from shared.keys import Keys
from shared.states import FinishReason, Status
from tests.fakes import (
    FakeEngines,
    ManualClock,
    fake_engines_factory,
    make_request,
    not_ready_within,
    stops_while_waiting,
)

KEYS = Keys("unit")
STREAM = KEYS.lane_stream("m", "short")
pytestmark = pytest.mark.usefixtures("heap_calls")  # the start-up heap freeze is recorded, not run (conftest)
DEAD = KEYS.dead_letter("m")
SPEC = dataclasses.replace(BUILTIN_MODELS["tiny-llama"], name="m", source="fake")


def settings(**overrides: Any) -> Settings:
    base: dict[str, Any] = {"key_prefix": "unit", "models": (SPEC,), "worker_name": "w1", "intake_block_ms": 20,
                            "reclaim_idle_s": 0.3, "max_deliveries": 2, "drain_budget_s": 0.2}
    return Settings(**{**base, **overrides}).validate()


@dataclass
class Running:
    worker: Worker
    engines: FakeEngines
    queue: MemoryQueue
    announcer: MemoryAnnouncer
    stop: asyncio.Event
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def running(q: MemoryQueue, s: Settings | None = None, **fake: Any) -> AsyncIterator[Running]:
    made: dict[str, FakeEngines] = {}
    announcer = MemoryAnnouncer()
    worker = Worker(s or settings(), queue=q, announcer=announcer, engines_factory=fake_engines_factory(made, **fake))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait([task, asyncio.create_task(worker.ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    try:
        yield Running(worker, made["m"], q, announcer, stop, task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def until(condition: Callable[[], bool], timeout: float = 3.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.002)


def state(q: MemoryQueue, rid: str) -> Status | None:
    rec = q.records.get(rid)
    return rec.state if rec else None


@pytest.mark.spawns
def test_the_worker_and_these_tests_import_no_torch():
    code = "import sys, tests.unit.test_worker; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


async def test_a_worker_freezes_its_heap_once_loaded_and_thaws_it_once_stopped(monkeypatch):
    """Its models' objects are what the freeze is for: they exist when it freezes; once stopped, they can be freed
    (a process that runs workers in turn, as this one does)."""
    import gpu_worker.worker as worker_module

    worker = Worker(settings(), queue=MemoryQueue(), announcer=MemoryAnnouncer(),
                    engines_factory=fake_engines_factory({}))
    calls: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(worker_module, "freeze_startup_heap",
                        lambda: calls.append(("freeze", list(worker.engines))) or 0)
    monkeypatch.setattr(worker_module, "thaw_heap", lambda: calls.append(("thaw", [])))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(worker.ready.wait(), 5)
    assert calls == [("freeze", ["m"])]
    stop.set()
    await asyncio.wait_for(task, 5)
    assert calls == [("freeze", ["m"]), ("thaw", [])]


async def test_results_are_written_then_entries_acked_and_released():
    q = MemoryQueue()
    async with running(q) as r:
        for i in range(3):
            await q.enqueue(STREAM, make_request(f"r{i}"))
        await until(lambda: all(state(q, f"r{i}") is Status.SUCCEEDED for i in range(3)) and not r.worker.held)
        assert q.entries(STREAM) == {} and await q.pending(STREAM, "w1", 10) == {}
        assert q.records["r0"].attempts == 1 and sorted(r.engines.computed) == ["r0", "r1", "r2"]
        assert r.announcer.workers["w1"]["models"] == ["m"]
    assert "w1" not in r.announcer.workers  # withdrawn on leaving


async def test_drain_stops_intake_finishes_or_hands_back_and_leaves_nothing_owned():
    q = MemoryQueue()
    async with running(q, settings(drain_budget_s=0.3), hold=lambda req: True) as r:
        await q.enqueue(STREAM, make_request("finishes"))
        await q.enqueue(STREAM, make_request("too-long"))
        await until(lambda: len(r.engines.running) == 2)
        t0 = time.monotonic()
        r.stop.set()
        await until(lambda: r.engines.drained_until is not None)
        late = await q.enqueue(STREAM, make_request("after-stop"))  # intake has stopped: nobody reads it
        r.engines.finish("finishes")  # running work may finish within the budget
        await asyncio.wait_for(r.task, 5)
        assert time.monotonic() - t0 < 0.3 + 0.5
    assert state(q, "finishes") is Status.SUCCEEDED
    # handed back, not failed: queued again (not shown running on a worker that let it go); another worker runs it
    assert state(q, "too-long") is Status.QUEUED
    fresh = q.entries(STREAM)
    assert late in fresh and len(fresh) == 2  # the late entry and the handed-back copy, both unread
    assert "after-stop" not in r.engines.computed
    assert await q.consumers(STREAM) == {}  # nothing left owned; the consumer is gone
    assert r.worker.held == {}
    other = await q.read("w2", [STREAM], 10, 0)
    assert {e.id for e in other} == set(fresh)


async def test_a_dead_consumers_entries_are_reclaimed_and_a_live_ones_are_not():
    clock = ManualClock()
    q = MemoryQueue(clock)
    await q.create_groups([STREAM])
    await q.enqueue(STREAM, make_request("orphan"))
    assert len(await q.read("dead", [STREAM], 10, 0)) == 1
    async with running(q, hold=lambda req: req.id == "long") as r:
        await q.enqueue(STREAM, make_request("long"))
        await until(lambda: "long" in r.engines.running)
        clock.advance(1.0)  # past the idle threshold: the dead consumer's entry is up for reclaim
        await until(lambda: state(q, "orphan") is Status.SUCCEEDED)
        assert await q.pending(STREAM, "dead", 10) == {}
        assert q.records["orphan"].attempts == 1
        clock.advance(1.0)
        await r.worker.upkeep.renew()  # the live worker's entry is renewed, so nobody else takes it
        assert await q.reclaim("rescuer", STREAM, 0.3, 10) == []
        assert "long" in r.worker.held and r.engines.computed.count("long") == 1
        r.engines.finish("long")
        await until(lambda: state(q, "long") is Status.SUCCEEDED)
    assert q.entries(STREAM) == {}


async def test_a_departed_workers_entries_are_taken_at_once_and_a_live_ones_are_not():
    clock = ManualClock()
    q = MemoryQueue(clock)
    await q.create_groups([STREAM])
    for rid in ("orphan-1", "orphan-2", "peers"):
        await q.enqueue(STREAM, make_request(rid))
    assert len(await q.read("gone", [STREAM], 2, 0)) == 2  # a worker that died: it announces nothing any more
    (peers,) = await q.read("peer", [STREAM], 1, 0)
    async with running(q, settings(reclaim_idle_s=600.0)) as r:  # no reclaim by idle time in this test
        r.announcer.workers["peer"] = {"instance": "p", "at": time.time()}  # alive: its heartbeat is current
        await r.worker.upkeep.take_departed("m")
        assert q.records == {}  # not idle for DEPARTED_IDLE_S yet (a worker may read before its first beat lands)
        clock.advance(DEPARTED_IDLE_S)
        await r.worker.upkeep.take_departed("m")
        await until(lambda: state(q, "orphan-1") is Status.SUCCEEDED and state(q, "orphan-2") is Status.SUCCEEDED)
        assert [q.records[rid].attempts for rid in ("orphan-1", "orphan-2")] == [1, 1]
        assert await q.pending(STREAM, "gone", 10) == {}
        assert list(await q.pending(STREAM, "peer", 10)) == [peers.id] and "peers" not in q.records
        r.announcer.workers.pop("peer")  # the peer went silent too
        await r.worker.upkeep.take_departed("m")
        await until(lambda: state(q, "peers") is Status.SUCCEEDED)
        assert r.engines.computed.count("peers") == 1


async def test_after_losing_redis_a_worker_judges_no_other_departed_until_every_live_one_has_beaten_again():
    # while Redis was gone (a failover, a restart) every worker's liveness mark may have expired
    clock = ManualClock()
    q = MemoryQueue(clock)
    await q.create_groups([STREAM])
    await q.enqueue(STREAM, make_request("orphan"))
    assert len(await q.read("gone", [STREAM], 1, 0)) == 1
    clock.advance(DEPARTED_IDLE_S)
    async with running(q, settings(reclaim_idle_s=600.0)) as r:
        up = r.worker.upkeep
        await up.check_departed(100.0)  # its first check: it has reached Redis for no time yet
        q.available = False
        await up.check_departed(100.0 + ALIVE_S)
        q.available = True
        await up.check_departed(102.0 + ALIVE_S)
        await up.check_departed(101.0 + 2 * ALIVE_S)
        assert "orphan" not in q.records and list(await q.pending(STREAM, "gone", 10)) != []
        await up.check_departed(102.0 + 2 * ALIVE_S)  # ALIVE_S of Redis without a break
        await until(lambda: state(q, "orphan") is Status.SUCCEEDED)


async def test_a_restarted_worker_takes_back_its_predecessors_entries_at_once(monkeypatch):
    monkeypatch.setattr(upkeep, "DEPARTED_IDLE_S", 0.1)
    monkeypatch.setattr(upkeep, "OWN_MARGIN_S", 0.05)
    clock = ManualClock()
    q = MemoryQueue(clock)
    await q.create_groups([STREAM])
    for rid in ("left-1", "left-2"):
        await q.enqueue(STREAM, make_request(rid))
    assert len(await q.read("w1", [STREAM], 2, 0)) == 2  # the worker's predecessor under its name, killed
    clock.advance(0.5)  # a supervisor restarts it at once; loading its models takes longer than that
    async with running(q, settings(reclaim_idle_s=600.0), hold=lambda req: req.id == "new", load_s=0.8) as r:
        await q.enqueue(STREAM, make_request("new"))
        await until(lambda: "new" in r.engines.running)
        await r.worker.upkeep.take_departed("m")
        await until(lambda: state(q, "left-1") is Status.SUCCEEDED and state(q, "left-2") is Status.SUCCEEDED)
        clock.advance(1.0)
        await r.worker.upkeep.take_departed("m")  # what this process read itself is never taken again
        assert r.engines.computed.count("new") == 1 and list(await q.pending(STREAM, "w1", 10)) != []
        r.engines.finish("new")
        await until(lambda: state(q, "new") is Status.SUCCEEDED)
    assert q.entries(STREAM) == {}


async def test_an_entry_delivered_too_often_is_dead_lettered_and_fails():
    clock = ManualClock()
    q = MemoryQueue(clock)
    await q.create_groups([STREAM])
    await q.enqueue(STREAM, make_request("poison"))
    await q.read("crashed-1", [STREAM], 10, 0)
    clock.advance(1.0)
    assert [e.deliveries for e in await q.reclaim("crashed-2", STREAM, 0.3, 10)] == [2]
    clock.advance(1.0)
    async with running(q, fail=lambda req: req.id == "raises") as r:  # max_deliveries=2: a third is one too many
        await q.enqueue(STREAM, make_request("raises"))
        await q.enqueue(STREAM, make_request("mate"))
        await until(lambda: state(q, "poison") is Status.FAILED and state(q, "mate") is Status.SUCCEEDED)
        assert "poison" not in r.engines.computed
        rec = q.records["poison"]
        assert rec.result is not None and rec.result.error is not None
        assert rec.result.error.code == "poison_request" and "dead-lettered" in rec.result.error.message
        (letter,) = q.entries(DEAD).values()
        assert letter[b"deliveries"] == b"3" and letter[b"stream"] == STREAM.encode()
        await until(lambda: state(q, "raises") is Status.FAILED)  # a model error fails that request alone
    assert q.entries(STREAM) == {}


class SlowHandBack(MemoryQueue):
    def __init__(self) -> None:
        super().__init__()
        self.go = asyncio.Event()

    async def hand_back(self, held: Sequence[Held]) -> None:
        await super().hand_back(held)
        await self.go.wait()  # the fresh entry is in the stream; ours is not released until the test says so


@pytest.mark.parametrize("queue", [MemoryQueue, SlowHandBack])
async def test_hand_back_queues_a_fresh_entry_and_drops_ours(queue: type[MemoryQueue]):
    # SlowHandBack: a hand-back to a less loaded worker (`gpu_worker.rebalance`) while this worker's intake has room
    # may be read back here before the publisher has released the old entry. The fresh entry is the request's now,
    # not a duplicate (acked as one, the request was lost: no worker held it, and it expired unrun)
    q = queue()
    async with running(q, hold=lambda req: True) as r:
        req = make_request("r0")
        first = await q.enqueue(STREAM, req)
        await until(lambda: "r0" in r.engines.running)
        r.engines.running.clear()
        r.worker.emit([HandBack([req])])
        await until(lambda: "r0" in r.worker.held and r.worker.held["r0"].entry_id != first)
        await until(lambda: "r0" in r.engines.running)  # read again, as any worker would
        assert first not in q.entries(STREAM) and len(q.entries(STREAM)) == 1
        if isinstance(q, SlowHandBack):
            q.go.set()
        await until(lambda: not r.worker.publisher.leaving)  # the publisher has released what it handed back
        assert "r0" in r.worker.held and r.engines.computed == ["r0", "r0"]
        r.engines.finish("r0")
        await until(lambda: state(q, "r0") is Status.SUCCEEDED and not r.worker.held and not q.entries(STREAM))


async def test_a_second_entry_for_a_held_request_is_acked_not_run_twice():
    q = MemoryQueue()
    async with running(q, hold=lambda req: True) as r:
        req = make_request("r0")
        first = await q.enqueue(STREAM, req)
        await q.enqueue(STREAM, req)  # a retried XADD
        await until(lambda: list(q.entries(STREAM)) == [first] and "r0" in r.engines.running)
        assert r.engines.computed == ["r0"] and r.worker.held["r0"].entry_id == first
        assert await q.pending(STREAM, "w1", 10) == {first: 1}
        r.engines.finish("r0")
        await until(lambda: state(q, "r0") is Status.SUCCEEDED and q.entries(STREAM) == {})


async def test_undecodable_entries_are_dead_lettered_and_the_worker_carries_on():
    q = MemoryQueue()
    async with running(q) as r:
        q.add(STREAM, {b"m": b"\xc1 not msgpack"})
        q.add(STREAM, {b"other": b"field"})
        await q.enqueue(STREAM, make_request("good"))
        await until(lambda: state(q, "good") is Status.SUCCEEDED and len(q.entries(DEAD)) == 2)
        assert all(f[b"reason"].startswith(b"undecodable") for f in q.entries(DEAD).values())
        assert q.entries(STREAM) == {} and r.engines.computed == ["good"]


async def test_cancelled_and_expired_requests_are_never_computed():
    q = MemoryQueue()
    async with running(q, hold=lambda req: True) as r:
        gone = make_request("cancelled-before")
        q.finish(result_for(gone, Status.CANCELLED, worker="gateway", now=time.time(), reason=FinishReason.CANCELLED))
        await q.enqueue(STREAM, gone)
        await q.enqueue(STREAM, make_request("late", timeout_s=-1))
        await q.enqueue(STREAM, make_request("running"))
        await until(lambda: "running" in r.engines.running)
        r.announcer.cancel("running")  # the gateway's cancel event
        await until(lambda: not r.worker.held and q.entries(STREAM) == {})
        assert r.engines.computed == ["running"] and r.engines.cancelled == ["running"]
        assert state(q, "late") is Status.EXPIRED and state(q, "cancelled-before") is Status.CANCELLED


async def test_the_worker_rides_out_an_unavailable_queue():
    q = MemoryQueue()
    async with running(q) as r:
        q.available = False
        q.add(STREAM, {b"m": encode(make_request("r0"))})  # wakes the blocked read into the outage
        await asyncio.sleep(0.15)
        q.available = True
        await until(lambda: state(q, "r0") is Status.SUCCEEDED)
        assert r.worker.redis is None


async def test_a_worker_started_before_its_queue_waits_for_it_instead_of_exiting(monkeypatch):
    """Redis not up yet when the worker starts (a boot order, a Redis restarting): it waits and becomes ready once
    Redis answers, never exits (a supervisor's restart loop would load the models again each time); a stop while
    it waits ends it cleanly."""
    from shared import redis_io

    monkeypatch.setattr(redis_io, "START_WAIT_MAX_S", 0.05)
    q = MemoryQueue()
    q.available = False
    made: dict[str, FakeEngines] = {}
    worker = Worker(settings(), queue=q, announcer=MemoryAnnouncer(), engines_factory=fake_engines_factory(made))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    await not_ready_within(task, worker.ready, 0.3)
    q.available = True
    await asyncio.wait_for(worker.ready.wait(), 5)
    q.add(STREAM, {b"m": encode(make_request("r0"))})
    await until(lambda: state(q, "r0") is Status.SUCCEEDED)
    stop.set()
    await asyncio.wait_for(task, 5)
    # stopped while it waits: returns, never ready
    q.available = False
    worker = Worker(settings(), queue=q, announcer=MemoryAnnouncer(), engines_factory=fake_engines_factory({}))
    stop = asyncio.Event()
    await stops_while_waiting(asyncio.create_task(worker.run(stop)), stop, worker.ready)


class _SwallowingAnnouncer(MemoryAnnouncer):
    """Each announcement swallows a cancellation that arrives while it is in flight and returns normally, as
    Python 3.11's `wait_for` inside redis-py does when the cancellation comes as the command completes."""

    def __init__(self) -> None:
        super().__init__()
        self.in_call = asyncio.Event()

    async def _call(self) -> None:
        self.in_call.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # a Redis call that returns only when cancelled, then swallows it

    async def heartbeat(self, worker: str, info: dict[str, Any]) -> None:
        await self._call()

    async def publish_stats(self, stats: Any) -> None:
        await self._call()


@pytest.mark.parametrize("loop", ["heartbeat", "stats"])
async def test_an_announcement_loop_ends_even_when_its_redis_call_swallows_the_cancellation(loop: str) -> None:
    """The worker cancels these loops once at shutdown and waits for them: one that ran on would hold the
    shutdown for ever."""
    from gpu_worker.announce import heartbeat_loop, stats_loop

    announcer = _SwallowingAnnouncer()
    task = asyncio.create_task(heartbeat_loop(announcer, "w1", dict) if loop == "heartbeat"
                               else stats_loop(announcer, dict))
    await announcer.in_call.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=1.0)
    assert done and task.cancelled()


async def test_a_worker_waits_while_another_live_worker_has_its_name(monkeypatch):
    """Two workers under one name overwrite each other's load reports (admission misjudges the capacity): the second
    waits, saying so, until the first stops beating; one restarted under the name of a dead one starts."""
    from gpu_worker import announce

    monkeypatch.setattr(announce, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(announce, "NAME_TAKEN_S", 0.3)
    announcer = MemoryAnnouncer()
    await announcer.heartbeat("w1", {"instance": "other", "at": time.time()})  # alive, under our name
    worker = Worker(settings(), queue=MemoryQueue(), announcer=announcer, engines_factory=fake_engines_factory({}))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    for _ in range(4):  # it keeps beating: ours waits
        await asyncio.sleep(0.1)
        await announcer.heartbeat("w1", {"instance": "other", "at": time.time()})
    assert not worker.ready.is_set()
    await asyncio.wait_for(worker.ready.wait(), 5)  # it stopped beating: ours starts, under the name
    assert announcer.workers["w1"]["instance"] == worker.instance
    stop.set()
    await asyncio.wait_for(task, 5)
