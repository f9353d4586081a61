"""Handing held work to a less loaded worker (`gpu_worker.rebalance`): whose figures count, how much goes, which
requests, and the loop that reads the figures and tells the engines and the intake."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import pytest

from gpu_worker import intake as intake_module
from gpu_worker import rebalance
from gpu_worker.commands import Release
from gpu_worker.intake import Intake
from gpu_worker.job import Job, JobState
from gpu_worker.lane_queue import LanePolicy, LaneQueue
from gpu_worker.load_report import LaneLoad, Snapshot
from gpu_worker.rebalance import Peer, lowest, peers, take
from shared.config import BUILTIN_MODELS, Settings
from shared.messages import InferenceRequest, LaneStat, LaneStats
from shared.states import Priority, Task

NOW_MS = 1_000_000


def stats(worker: str, *, free: int, waiting: dict[str, int], at_ms: int = NOW_MS) -> LaneStats:
    return LaneStats(model="m", worker=worker, at_ms=at_ms, max_rows=4, free_rows=free, deadline_aware=True,
                     prefill_fixed_ms=1.0, prefill_ms_per_token=0.1, decode_ms_per_step=10.0,
                     lanes=tuple(LaneStat(lane, n, 0, 1.0, 0.0) for lane, n in waiting.items()))


def job(i: int, lane: str = "short", *, deadline: float = 100.0, priority: Priority = Priority.INTERACTIVE,
        arrived: float = 0.0) -> Job:
    req = InferenceRequest(id=f"r{i}", tenant="t", model="m", task=Task.GENERATE, input={"input_ids": [1]},
                           params={"max_new_tokens": 4}, lane=lane, priority=priority, created_ms=0,
                           deadline_ms=int(deadline * 1000), est_tokens=5)
    return Job(id=req.id, lane=lane, rank=Priority(priority).rank, deadline=deadline, arrived=arrived, tokens=5,
               prompt_tokens=1, new_tokens=4, request=req)


def queues(*jobs: Job, lanes: tuple[str, ...] = ("short", "long"), fifo: bool = False) -> dict[str, LaneQueue]:
    out = {lane: LaneQueue(LanePolicy(lane, 0.0), fifo=fifo) for lane in lanes}
    for j in jobs:
        out[j.lane].push(j)
    return out


def test_only_other_workers_fresh_figures_with_less_than_a_turn_waiting_count():
    got = peers([stats("me", free=4, waiting={"short": 0}),
                 stats("busy", free=0, waiting={"short": 4, "long": 0}),  # a turn of its 4 rows waiting
                 stats("old", free=4, waiting={"short": 0}, at_ms=NOW_MS - rebalance.FRESH_MS - 1),
                 stats("idle", free=3, waiting={"short": 0, "long": 0}),
                 stats("filling", free=0, waiting={"short": 3}),
                 stats("skewed", free=2, waiting={"short": 1}, at_ms=NOW_MS + 500)], "me", NOW_MS)
    assert got == [Peer(frozenset({"short", "long"}), -3, 4, NOW_MS), Peer(frozenset({"short"}), 3, 4, NOW_MS),
                   Peer(frozenset({"short"}), -1, 4, NOW_MS + 500)]


def test_the_lowest_peer_serving_the_lanes_with_figures_taken_since():
    idle = Peer(frozenset({"short"}), -4, 4, 50)
    less = Peer(frozenset({"short"}), 1, 4, 60)
    other_lanes = Peer(frozenset({"long"}), -8, 8, 70)
    assert lowest([less, idle, other_lanes], ("short",), since_ms=0) == idle
    assert lowest([less, idle, other_lanes], ("short", "long"), since_ms=0) == other_lanes
    assert lowest([less, idle], ("short",), since_ms=55) == less  # the idle one's figures are from before
    assert lowest([less, idle], ("short",), since_ms=60) is None
    assert lowest([], ("short",), since_ms=0) is None


def test_take_hands_the_most_urgent_it_cannot_start_now_up_to_a_turn_of_the_peer():
    q = queues(*(job(i, deadline=100.0 + i) for i in range(20)))
    # 20 waiting, 1 row free: r0 starts here now; the peer has 4 of 4 rows free: 8 go (its free rows and a turn)
    got = take(q, 1, Release(frozenset({"short"}), -4, 4))
    assert [j.id for j in got] == [f"r{i}" for i in range(1, 9)]
    assert {j.state for j in got} == {JobState.DONE}
    assert sorted(int(j.id[1:]) for j in q["short"].items()) == [0, *range(9, 20)]
    assert q["short"].pop().id == "r0"  # the queue still pops in order, without the ones taken
    q = queues(*(job(i) for i in range(20)))
    assert len(take(q, 0, Release(frozenset({"short"}), 2, 4))) == 2  # 2 waiting there already: 2 more


def test_take_leaves_the_two_level_and_never_gives_what_it_can_start_now():
    q = queues(*(job(i) for i in range(6)))
    assert len(take(q, 0, Release(frozenset({"short"}), -2, 8))) == 4  # levels 6 and -2: 4 go, leaving 2 and 2
    q = queues(*(job(i) for i in range(3)))
    assert take(q, 3, Release(frozenset({"short"}), -4, 4)) == []  # every one starts at once here
    assert [j.id for j in take(q, 2, Release(frozenset({"short"}), -4, 4))] == ["r2"]  # one cannot: it goes


def test_take_orders_by_priority_then_deadline_or_by_arrival_in_fifo_mode():
    batch = job(0, deadline=50.0, priority=Priority.BATCH)
    late = job(1, deadline=300.0)
    soon = job(2, deadline=60.0)
    q = queues(batch, late, soon)
    assert [j.id for j in take(q, 0, Release(frozenset({"short"}), -1, 1))] == ["r2", "r1"]  # interactive first
    assert [j.id for j in q["short"].items()] == ["r0"]
    q = queues(job(0, arrived=3.0), job(1, arrived=1.0), job(2, arrived=2.0), fifo=True)
    assert [j.id for j in take(q, 0, Release(frozenset({"short"}), -1, 1))] == ["r1", "r2"]  # the earliest arrivals


def test_take_gives_only_lanes_the_peer_serves_and_never_a_request_that_moved_before():
    q = queues(job(0, "long"), job(1, "long"), job(2, "long"), job(3, "short"), job(4, "short"))
    got = take(q, 0, Release(frozenset({"short"}), -5, 5))
    assert sorted(j.id for j in got) == ["r3", "r4"]  # 5 against 5 free would move 5: only the short ones can go
    assert len(q["long"]) == 3
    moved = job(5)
    moved.request = dataclasses.replace(moved.req, moved=1)
    q = queues(moved, job(6, deadline=200.0))
    assert [j.id for j in take(q, 0, Release(frozenset({"short"}), -4, 4))] == ["r6"]
    assert [j.id for j in q["short"].items()] == ["r5"]


@dataclass
class FakeScheduler:
    own_lanes: tuple[str, ...]


@dataclass
class FakeLoop:
    load: Snapshot
    scheduler: FakeScheduler
    got: list[Release] = field(default_factory=list)
    looked: asyncio.Event = field(default_factory=asyncio.Event)  # the loop read its figures (a check ran)

    @property
    def snapshot(self) -> Snapshot:
        self.looked.set()
        return self.load

    def submit(self, cmd: Release) -> None:
        self.got.append(cmd)


def loaded(waiting: int, free: int) -> FakeLoop:
    snap = Snapshot(at=1.0, lanes={"short": LaneLoad(waiting, 4 - free, 1.0, 0.0)}, max_rows=4, free_rows=free)
    return FakeLoop(snap, FakeScheduler(("short",)))


async def run_checks(monkeypatch, loops: dict[str, list[FakeLoop]], figures: list[list[LaneStats]],
                     clock: list[int], blocking: set[str] | None = None) -> dict[str, bool]:
    """The loop for as many checks as `figures` holds (each check reads the next), on a clock set per check; a peer
    with idle rows counts from the second check that finds it (its intake polls from the first)."""
    monkeypatch.setattr(rebalance, "CHECK_S", 0.0)
    reads = iter(figures)
    done = asyncio.Event()

    async def read(model: str) -> list[LaneStats]:
        try:
            return next(reads)
        except StopIteration:
            done.set()
            await asyncio.Event().wait()  # no more figures: the test cancels it here
            raise

    peer_room: dict[str, bool] = {}
    task = asyncio.create_task(rebalance.rebalance_loop(loops, "me", read, peer_room, lambda: clock[0],
                                                        blocking=blocking if blocking is not None else set()))
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return peer_room


async def test_the_loop_tells_a_loaded_engine_once_per_figures_taken_after_its_last_hand_back(monkeypatch):
    mine = loaded(waiting=20, free=0)
    idle = stats("b", free=4, waiting={"short": 0}, at_ms=NOW_MS)
    later = stats("b", free=3, waiting={"short": 0}, at_ms=NOW_MS + rebalance.SETTLE_MS + 1)
    peer_room = await run_checks(monkeypatch, {"m": [mine]}, [[idle], [idle], [idle], [later]], [NOW_MS])
    assert peer_room == {"m": True}  # its intake polls while it holds more than it can start
    assert mine.got == [Release(frozenset({"short"}), -4, 4), Release(frozenset({"short"}), -3, 4)]  # not twice on one


async def test_nothing_goes_to_an_idle_peer_while_a_blocking_read_of_its_own_is_in_flight(monkeypatch):
    # begun before its intake polled, that read would be served the hand-back first: it blocked before the peer
    mine = loaded(waiting=20, free=0)
    idle = stats("b", free=4, waiting={"short": 0}, at_ms=NOW_MS)
    blocking = {"m"}
    await run_checks(monkeypatch, {"m": [mine]}, [[idle], [idle], [idle]], [NOW_MS], blocking)
    assert mine.got == []
    blocking.clear()  # it returned; the intake polls from now on
    await run_checks(monkeypatch, {"m": [mine]}, [[idle], [idle]], [NOW_MS])
    assert mine.got == [Release(frozenset({"short"}), -4, 4)]


async def test_no_peer_short_of_work_changes_nothing(monkeypatch):
    mine = loaded(waiting=2, free=0)
    busy = stats("b", free=1, waiting={"short": 5})  # a turn of its rows waiting
    await run_checks(monkeypatch, {"m": [mine]}, [[], [busy], [stats("me", free=4, waiting={})]], [NOW_MS])
    assert mine.got == []


async def test_an_engine_that_can_start_what_waits_reads_no_figures(monkeypatch):
    monkeypatch.setattr(rebalance, "CHECK_S", 0.001)
    idle_here = loaded(waiting=1, free=4)  # what waits starts at once here (a lane's window)
    reads: list[str] = []

    async def read(model: str) -> list[LaneStats]:
        reads.append(model)
        return [stats("b", free=4, waiting={"short": 0})]

    task = asyncio.create_task(rebalance.rebalance_loop({"m": [idle_here]}, "me", read, {}, lambda: NOW_MS))
    for _ in range(3):  # three checks
        await idle_here.looked.wait()
        idle_here.looked.clear()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert reads == [] and idle_here.got == []


@dataclass
class CountingLoop:
    waiting: int
    free_rows: int

    @property
    def scheduler(self) -> list[int]:
        return [0] * self.waiting  # its len: the waiting requests

    @property
    def runner(self) -> CountingLoop:
        return self


class Engines(list):
    def submit(self, requests: list, now: float) -> None:
        pass


class RecordingQueue:
    def __init__(self) -> None:
        self.blocks: list[tuple[float, float]] = []  # (when, how long it would block)
        self.blocking_seen: set[bool] = set()  # whether the intake said a blocking read was in flight, per read
        self.intake: Intake | None = None
        self.three = asyncio.Event()

    async def read(self, consumer: str, streams: list[str], count: int, block_s: float) -> list:
        self.blocks.append((time.monotonic(), block_s))
        self.blocking_seen.add("m" in self.intake.blocking)
        if len(self.blocks) >= 3:
            self.three.set()
        await asyncio.sleep(0)  # nothing there: a blocking read would wait here, this fake answers at once
        return []


@pytest.mark.parametrize(("peer_room", "waiting", "polls"), [(True, 6, True), (True, 2, False), (False, 6, False)])
async def test_the_intake_polls_only_while_it_holds_more_than_it_can_start_and_a_peer_has_idle_rows(
        peer_room: bool, waiting: int, polls: bool):
    spec = dataclasses.replace(BUILTIN_MODELS["tiny-llama"], name="m", source="fake")
    settings = Settings(key_prefix="unit", models=(spec,), worker_name="w1", intake_block_ms=20).validate()
    queue = RecordingQueue()
    engines = Engines([CountingLoop(waiting, 4)])
    intake = Intake(settings, queue, "w1", {"m": engines}, {}, asyncio.Event(), lambda out: asyncio.sleep(0))
    queue.intake = intake
    intake.peer_room["m"] = peer_room
    assert intake.loaded("m") is (waiting > 4)
    task = asyncio.create_task(intake.run("m"))
    await asyncio.wait_for(queue.three.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert {block for _, block in queue.blocks} == ({0.0} if polls else {0.02})
    assert queue.blocking_seen == ({False} if polls else {True})  # what the rebalance loop waits on
    if polls:  # not a busy loop: a poll that found nothing waits before the next
        assert queue.blocks[2][0] - queue.blocks[0][0] >= 2 * intake_module.POLL_S * 0.9


async def test_the_loop_ends_even_when_its_redis_call_swallows_the_cancellation(monkeypatch):
    """The worker cancels it once at shutdown and waits for it: one that ran on held the shutdown for ever (seen on a
    Redis Cluster, whose client can swallow a cancellation)."""
    monkeypatch.setattr(rebalance, "CHECK_S", 0.001)
    in_call = asyncio.Event()

    async def swallowing(model: str) -> list[LaneStats]:
        in_call.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()  # a Redis call that never answers
        return []

    task = asyncio.create_task(rebalance.rebalance_loop({"m": [loaded(waiting=8, free=0)]}, "me", swallowing, {}))
    await in_call.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=1.0)
    assert done and task.cancelled()
