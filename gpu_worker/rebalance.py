"""Work one worker holds while another worker of the same model runs short of work goes back to the stream for it.

A worker reads ahead of its rows (`gpu_worker.intake`: 32 requests or more, so that it starts them in priority and
deadline order across a window of the stream). With several workers, the one that reads first takes a burst's whole
window: with 4 rows each, 40 requests ran on one worker in 10.4 s while the other sat idle. So every `CHECK_S` each
worker reads the load its peers publish (`LaneStats`, the figures admission reads) and, per engine with more waiting
requests than free rows:

- a level is an engine's waiting requests less its free rows (negative: rows to spare). It looks for a peer engine
  serving any of its lanes whose level is below one turn of its rows: rows free, or about to be with little waiting
  (one with a turn or more waiting does not count: under a steady overload every worker holds a window of work, and
  moving it gains nothing and costs Redis writes);
- it hands back, as fresh stream entries, waiting requests of those lanes it cannot start now: the first in its start
  order (the most urgent go to the rows that are free soonest, as one EDF queue over both workers would start them),
  enough to bring the peer to one turn of its rows, at most half the difference of the two levels (`take`);
- a request moves once at most (`InferenceRequest.moved`): read back by the worker that handed it back (its intake
  may read first), or by a peer that then fills up, it stays. So nothing goes back and forth.

The peer, with room in its read-ahead, reads them at once: one script writes them (`gpu_worker.hand_back_script`),
so a peer waiting on the streams is served all of them, and while a peer has idle rows this worker polls the streams
rather than waits on them (`Intake.peer_room`), so no blocking read of its own is served first. Pure but for
`rebalance_loop` (the clock and the figures are passed in). It acts on a peer's figures only when they were taken
after its own last hand-back (`SETTLE_MS` after it): figures from before show none of it, and acting on them twice
would send the peer too much.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gpu_worker.commands import Release
from gpu_worker.job import Job, JobState
from gpu_worker.lane_queue import LaneQueue
from gpu_worker.load_report import Snapshot
from shared.messages import LaneStats
from shared.redis_io import raise_if_cancelling


class EngineLoop(Protocol):
    """What the loop needs of a compute loop (`ModelLoop`, which imports `take` from here: no import back)."""

    @property
    def snapshot(self) -> Snapshot: ...

    @property
    def scheduler(self) -> Any: ...  # its `own_lanes`

    def submit(self, cmd: Release) -> None: ...

CHECK_S = 0.25  # how often peers' figures are read (they publish every 0.5 s)
FRESH_MS = 3_000  # a peer's figures older (or newer, by clock skew) than this do not count: it stopped, or hangs
SETTLE_MS = 250  # a peer's figures count again once taken this long after this worker's last hand-back
MAX_MOVES = 1  # a request is handed to another worker this often at most


@dataclass(frozen=True, slots=True)
class Peer:
    """One engine of another worker with less than a turn of its rows waiting: the lanes it serves, its level (waiting
    less free rows), its rows, when its figures were taken."""

    lanes: frozenset[str]
    level: int
    rows: int
    at_ms: int


def peers(stats: Iterable[LaneStats], me: str, now_ms: int) -> list[Peer]:
    """Other workers' engines of a model with less than a turn of their rows waiting, from fresh figures."""
    out = [Peer(frozenset(lane.lane for lane in s.lanes), sum(lane.waiting for lane in s.lanes) - s.free_rows,
                s.max_rows, s.at_ms) for s in stats if s.worker != me and abs(now_ms - s.at_ms) <= FRESH_MS]
    return [p for p in out if p.level < p.rows]


def lowest(others: Iterable[Peer], lanes: Iterable[str], since_ms: int) -> Peer | None:
    """The least loaded peer engine serving any of `lanes`, of those with figures taken after `since_ms`."""
    fit = [p for p in others if not p.lanes.isdisjoint(lanes) and p.at_ms > since_ms]
    return min(fit, key=lambda p: (p.level, -p.at_ms)) if fit else None


def take(queues: Mapping[str, LaneQueue], free_rows: int, release: Release) -> list[Job]:
    """Remove and return the waiting requests to hand back for `release`'s peer: after the first `free_rows` in this
    engine's start order (it starts those now), the next ones of the lanes the peer serves that have not moved
    before; enough to bring the peer to a turn of its rows waiting, at most half the difference of the two levels,
    so that this engine does not end the less loaded one."""
    waiting = {job.id: (name, job) for name, q in queues.items() for job in q.items()}
    order = sorted((queues[name].key(job), rid) for rid, (name, job) in waiting.items())
    level = len(order) - free_rows
    n = min(level, (level - release.level) // 2, release.rows - release.level)
    movable = [waiting[rid] for _, rid in order[max(0, free_rows):]]
    chosen = [(name, job) for name, job in movable if name in release.lanes and job.req.moved < MAX_MOVES][:max(0, n)]
    for name, job in chosen:
        queues[name].remove(job.id)
        job.state = JobState.DONE  # it leaves the compute side, as a hand-back
    return [job for _, job in chosen]


async def rebalance_loop(engines: Mapping[str, Iterable[EngineLoop]], me: str,
                         read: Callable[[str], Awaitable[list[LaneStats]]], peer_room: dict[str, bool],
                         clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
                         blocking: Container[str] = frozenset()) -> None:
    """Every `CHECK_S`: read each model's published figures; tell each engine with more waiting than free rows of the
    least loaded peer engine serving its lanes, if one has less than a turn waiting. `blocking`: the models whose
    intake has a blocking read in flight (`Intake.blocking`): none is handed to an idle peer until it has returned."""
    handed_ms: dict[str, int] = {}
    while True:
        await asyncio.sleep(CHECK_S)
        for model, group in engines.items():
            loaded = [loop for loop in group if sum(load.waiting for load in loop.snapshot.lanes.values())
                      > loop.snapshot.free_rows]
            if not loaded:
                continue
            figures = await read(model)
            raise_if_cancelling()  # a Redis call may swallow the worker's cancellation at shutdown: never run on
            found = peers(figures, me, clock_ms())
            # while a peer has idle rows, the intake polls instead of waiting on the streams (`Intake.peer_room`):
            # once its last blocking read has returned (up to `intake_block_ms` later: at the default 1 s, a hand-back
            # sent after one check went to that read in 3 runs of 4 in an outside probe), what is handed back for the
            # peer cannot go to a read of this worker's own
            was, peer_room[model] = peer_room.get(model, False), any(p.level < 0 for p in found)
            others = [p for p in found if p.level >= 0 or (was and model not in blocking)]
            since = handed_ms.get(model, -SETTLE_MS) + SETTLE_MS
            for loop in loaded if others else ():
                peer = lowest(others, loop.scheduler.own_lanes, since)
                if peer is not None:
                    loop.submit(Release(peer.lanes, peer.level, peer.rows))
                    handed_ms[model] = clock_ms()
