"""Work one worker holds while another worker of the same model has rows to spare goes back to the stream for it.

A worker reads ahead of its rows (`gpu_worker.intake`: 32 requests or more, so that it starts them in priority and
deadline order across a window of the stream). With several workers, the one that reads first takes a burst's whole
window: with 4 rows each, 40 requests ran on one worker in 10.4 s while the other sat idle (6.3 s with this). So every
`CHECK_S` each worker reads the load its peers publish (`LaneStats`, the figures admission reads) and, per engine:

- its level is its waiting requests less its free rows (negative: rows to spare), a peer engine's the same;
- where a peer engine that serves its lanes is at least 2 lower, it hands back the waiting requests it would start
  last, half the difference (so that both end level), never one it can start at once (`take`); the peer, which has
  room in its read-ahead, reads them from the stream;
- while a peer is lower, its intake holds no more than its rows (`Intake.lean`): it does not read back what it
  handed back, and the stream's new work goes to the peer.

Pure but for `rebalance_loop` (the clock and the figures are passed in). It acts on a peer's figures only when they
were taken after its own last hand-back (`SETTLE_MS` after it): figures from before show none of it, and acting on
them twice would send the peer too much, which it would then hand back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.commands import Release
from gpu_worker.job import Job, JobState
from gpu_worker.lane_queue import LaneQueue
from shared.messages import LaneStats

if TYPE_CHECKING:
    from gpu_worker.engines import ModelEngines

CHECK_S = 0.25  # how often peers' figures are read (they publish every 0.5 s)
FRESH_MS = 3_000  # a peer's figures older than this do not count (a worker that stopped or hangs)
SETTLE_MS = 250  # a peer's figures count again once taken this long after this worker's last hand-back


@dataclass(frozen=True, slots=True)
class Peer:
    """One engine of another worker: the lanes it serves, its level (waiting less free rows), when it was taken."""

    lanes: frozenset[str]
    level: int
    at_ms: int


def peers(stats: Iterable[LaneStats], me: str, now_ms: int) -> list[Peer]:
    """Other workers' engines of a model, from their published figures, fresh ones only."""
    return [Peer(frozenset(lane.lane for lane in s.lanes), sum(lane.waiting for lane in s.lanes) - s.free_rows,
                 s.at_ms) for s in stats if s.worker != me and abs(now_ms - s.at_ms) <= FRESH_MS]


def lowest(others: Iterable[Peer], lanes: Iterable[str], level: int, since_ms: int) -> Peer | None:
    """The least loaded peer engine serving any of `lanes` with figures taken after `since_ms`, if it is at least 2
    below `level` (one request moved makes a difference of 1 no difference)."""
    fit = [p for p in others if not p.lanes.isdisjoint(lanes) and p.at_ms > since_ms and p.level <= level - 2]
    return min(fit, key=lambda p: (p.level, -p.at_ms)) if fit else None


def take(queues: Mapping[str, LaneQueue], free_rows: int, release: Release) -> list[Job]:
    """Remove and return the waiting requests to hand back to `release`'s peer: of the lanes it serves, those this
    engine would start last, half the difference of the two levels, none this engine could start now."""
    waiting = sum(len(q) for q in queues.values())
    level = waiting - free_rows
    n = min(max(0, level), (level - release.level) // 2)
    if n <= 0:
        return []
    jobs = [(q.key(job), job.id, name) for name, q in queues.items() if name in release.lanes for job in q.items()]
    out: list[Job] = []
    for _, rid, name in sorted(jobs)[len(jobs) - min(n, len(jobs)):]:
        job = queues[name].remove(rid)
        if job is not None:
            job.state = JobState.DONE  # it leaves the compute side, as a hand-back
            out.append(job)
    return out


async def rebalance_loop(engines: Mapping[str, ModelEngines], me: str,
                         read: Callable[[str], Awaitable[list[LaneStats]]], lean: dict[str, bool],
                         clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)) -> None:
    """Every `CHECK_S`: read each model's published figures, hand back to lower peers, set the intake's `lean`."""
    handed_ms: dict[str, int] = {}
    while True:
        await asyncio.sleep(CHECK_S)
        for model, group in engines.items():
            others = peers(await read(model), me, clock_ms())
            since = handed_ms.get(model, -SETTLE_MS) + SETTLE_MS
            lean[model] = False
            for loop in group if others else ():
                snap = loop.snapshot
                level = sum(load.waiting for load in snap.lanes.values()) - snap.free_rows
                lean[model] |= any(not p.lanes.isdisjoint(loop.scheduler.own_lanes) and p.level <= level - 2
                                   for p in others)
                peer = lowest(others, loop.scheduler.own_lanes, level, since)
                if peer is not None and level > 0:
                    loop.submit(Release(peer.lanes, peer.level))
                    handed_ms[model] = clock_ms()
