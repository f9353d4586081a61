"""Handing held work to a less loaded worker (`gpu_worker.rebalance`): whose figures count, how much goes, which
requests, and the loop that reads the figures and tells the engines and the intake."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from gpu_worker import rebalance
from gpu_worker.commands import Release
from gpu_worker.job import Job, JobState
from gpu_worker.lane_queue import LanePolicy, LaneQueue
from gpu_worker.load_report import LaneLoad, Snapshot
from gpu_worker.rebalance import Peer, lowest, peers, take
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


def test_only_other_workers_fresh_figures_count():
    got = peers([stats("me", free=4, waiting={"short": 0}), stats("b", free=3, waiting={"short": 1, "long": 2}),
                 stats("old", free=4, waiting={"short": 0}, at_ms=NOW_MS - rebalance.FRESH_MS - 1),
                 stats("skewed", free=2, waiting={"short": 0}, at_ms=NOW_MS + 500)], "me", NOW_MS)
    assert got == [Peer(frozenset({"short", "long"}), 0, NOW_MS), Peer(frozenset({"short"}), -2, NOW_MS + 500)]


def test_the_lowest_peer_serving_the_lanes_at_least_two_below_with_figures_taken_since():
    idle = Peer(frozenset({"short"}), -4, 50)
    busy = Peer(frozenset({"short"}), 3, 60)
    other_lanes = Peer(frozenset({"long"}), -8, 70)
    assert lowest([busy, idle, other_lanes], ("short",), 6, since_ms=0) == idle
    assert lowest([busy, idle, other_lanes], ("short", "long"), 6, since_ms=0) == other_lanes
    assert lowest([busy, idle], ("short",), 6, since_ms=55) == busy  # the idle one's figures are from before
    assert lowest([busy, idle], ("short",), 6, since_ms=60) is None
    assert lowest([idle], ("short",), -3, since_ms=0) is None  # 1 apart: moving one changes nothing
    assert lowest([idle], ("short",), -2, since_ms=0) == idle
    assert lowest([], ("short",), 10, since_ms=0) is None


def test_take_hands_back_half_the_difference_those_it_would_start_last():
    q = queues(*(job(i, deadline=100.0 + i) for i in range(10)))
    # 10 waiting, no row free: level 10; the peer's -4 (4 rows free): 7 go, leaving 3 and 3
    got = take(q, 0, Release(frozenset({"short"}), -4))
    assert sorted(j.id for j in got) == [f"r{i}" for i in range(3, 10)]
    assert {j.state for j in got} == {JobState.DONE}
    assert sorted(j.id for j in q["short"].items()) == ["r0", "r1", "r2"]
    assert q["short"].pop().id == "r0"  # the queue still pops in order, without the ones taken


def test_take_never_gives_what_it_can_start_now_nor_moves_one_for_nothing():
    q = queues(*(job(i) for i in range(3)))
    assert take(q, 3, Release(frozenset({"short"}), -4)) == []  # every one starts at once here
    assert take(q, 2, Release(frozenset({"short"}), -4)) != []  # one cannot: it goes
    q = queues(*(job(i) for i in range(3)))
    assert take(q, 0, Release(frozenset({"short"}), 2)) == []  # 3 against 2
    assert [j.id for j in take(q, 0, Release(frozenset({"short"}), 1))] == ["r2"]  # 3 against 1: one goes


def test_take_orders_by_priority_then_deadline_or_by_arrival_in_fifo_mode():
    batch = job(0, deadline=50.0, priority=Priority.BATCH)
    late = job(1, deadline=300.0)
    soon = job(2, deadline=60.0)
    q = queues(batch, late, soon)
    assert [j.id for j in take(q, 0, Release(frozenset({"short"}), -1))] == ["r1", "r0"]  # batch work starts last
    assert [j.id for j in q["short"].items()] == ["r2"]
    q = queues(job(0, arrived=3.0), job(1, arrived=1.0), job(2, arrived=2.0), fifo=True)
    assert [j.id for j in take(q, 0, Release(frozenset({"short"}), -1))] == ["r2", "r0"]  # the latest arrivals


def test_take_gives_only_lanes_the_peer_serves():
    q = queues(job(0, "long"), job(1, "long"), job(2, "long"), job(3, "short"), job(4, "short"))
    got = take(q, 0, Release(frozenset({"short"}), -5))
    assert sorted(j.id for j in got) == ["r3", "r4"]  # 5 against -5 would move 5: only the short ones can go
    assert len(q["long"]) == 3


@dataclass
class FakeScheduler:
    own_lanes: tuple[str, ...]


@dataclass
class FakeLoop:
    snapshot: Snapshot
    scheduler: FakeScheduler
    got: list[Release] = field(default_factory=list)

    def submit(self, cmd: Release) -> None:
        self.got.append(cmd)


def loaded(waiting: int, free: int) -> FakeLoop:
    snap = Snapshot(at=1.0, lanes={"short": LaneLoad(waiting, 4 - free, 1.0, 0.0)}, max_rows=4, free_rows=free)
    return FakeLoop(snap, FakeScheduler(("short",)))


async def run_checks(monkeypatch, loops: dict[str, list[FakeLoop]], figures: list[list[LaneStats]],
                     clock: list[int]) -> dict[str, bool]:
    """The loop for as many checks as `figures` holds (each check reads the next), on a clock set per check."""
    monkeypatch.setattr(rebalance, "CHECK_S", 0.0)
    lean: dict[str, bool] = {}
    reads = iter(figures)
    done = asyncio.Event()

    async def read(model: str) -> list[LaneStats]:
        try:
            return next(reads)
        except StopIteration:
            done.set()
            await asyncio.sleep(3600)
            raise

    task = asyncio.create_task(rebalance.rebalance_loop(loops, "me", read, lean, lambda: clock[0]))
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    return lean


async def test_the_loop_hands_back_once_per_figures_taken_after_its_last_hand_back(monkeypatch):
    mine = loaded(waiting=20, free=0)
    idle = stats("b", free=4, waiting={"short": 0}, at_ms=NOW_MS)
    later = stats("b", free=4, waiting={"short": 0}, at_ms=NOW_MS + rebalance.SETTLE_MS + 1)
    lean = await run_checks(monkeypatch, {"m": [mine]}, [[idle], [idle], [later]], [NOW_MS])
    assert mine.got == [Release(frozenset({"short"}), -4)] * 2  # not again on the same figures
    assert lean == {"m": True}  # and the intake holds no more than its rows meanwhile


async def test_no_peer_or_a_busier_one_changes_nothing(monkeypatch):
    mine = loaded(waiting=2, free=0)
    busy = stats("b", free=0, waiting={"short": 5})
    lean = await run_checks(monkeypatch, {"m": [mine]}, [[], [busy], [stats("me", free=4, waiting={})]], [NOW_MS])
    assert mine.got == [] and lean == {"m": False}


async def test_an_idle_worker_asks_nothing_of_an_idle_peer(monkeypatch):
    mine = loaded(waiting=0, free=4)
    lean = await run_checks(monkeypatch, {"m": [mine]}, [[stats("b", free=4, waiting={"short": 0})]], [NOW_MS])
    assert mine.got == [] and lean == {"m": False}
