"""Upkeep of stream ownership, on a steady interval (a third of the reclaim idle time):
- renew every entry this worker holds, so that no live worker's entry is ever reclaimed;
- reclaim entries idle past `reclaim_idle_s` (their worker died or hung) while not draining; one
  delivered more than `max_deliveries` times keeps killing workers: it is dead-lettered and its
  request ends `failed`;
- now and then, delete consumers of departed workers that own nothing.
And, every heartbeat, take over at once the entries of a worker that is known to be gone, rather than
after `reclaim_idle_s`: one whose liveness mark expired (`Announcer.departed`: silent for `ALIVE_S`), and
this worker's own predecessor under its name (a supervisor's restart), whose entries were read before
this process started. Only entries idle for `DEPARTED_IDLE_S` are taken (a worker that just started may
read before its first heartbeat lands), and other workers are judged only after `ALIVE_S` of this worker
reaching Redis without a break; the delivery counts and the dead-letter rule are the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

import structlog

from gpu_worker import metrics
from gpu_worker.announce import ALIVE_S, HEARTBEAT_S
from gpu_worker.intake import Intake
from gpu_worker.outcomes import failed_outcome
from gpu_worker.work_queue import DeadLetter, Entry, Finished, QueueUnavailable, decode_request
from shared.errors import CodecError
from shared.redis_io import raise_if_cancelling

log = structlog.get_logger(__name__)

CLEANUP_EVERY = 10  # upkeep cycles between consumer clean-ups
MIN_INTERVAL_S = 0.1
DEPARTED_IDLE_S = 2 * HEARTBEAT_S
OWN_MARGIN_S = 1.0  # an own entry idle this much longer than this process has run was read by its predecessor


class Upkeep:
    def __init__(self, intake: Intake, draining: Callable[[], bool],
                 departed: Callable[[Sequence[str]], Awaitable[set[str]]] | None = None) -> None:
        self.intake = intake
        self.queue = intake.queue
        self.settings = intake.settings
        self.consumer = intake.consumer
        self._draining = draining
        self._departed = departed
        self._reading_since = time.monotonic()  # set again by `begin`, just before intake's first read
        self._reached_since: float | None = None  # since when every departed-check reached Redis (monotonic)

    async def run(self) -> None:
        interval = max(MIN_INTERVAL_S, self.settings.reclaim_idle_s / 3)
        cycle = 0
        while True:
            await asyncio.sleep(interval)
            raise_if_cancelling()  # a cancellation swallowed inside a Redis call still stops the loop
            cycle += 1
            try:
                await self.renew()
                for model in list(self.intake.engines):
                    if not self._draining():
                        await self.reclaim(model)
                if cycle % CLEANUP_EVERY == 0:
                    streams = [s for m in self.intake.engines for s in self.intake.streams(m)]
                    await self.queue.clean_departed(streams, self.consumer, 2 * self.settings.reclaim_idle_s)
            except QueueUnavailable as exc:
                log.warning("upkeep: queue unavailable", error=str(exc))

    def begin(self) -> None:
        """Intake is about to read: what this process owns from now on is its own (a restart under the same name
        comes seconds after loading its models, and what its predecessor read is that much older)."""
        self._reading_since = time.monotonic()

    async def watch(self) -> None:
        """Take over the entries of departed workers, every heartbeat, while not draining."""
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            raise_if_cancelling()
            if not self._draining():
                await self.check_departed(time.monotonic())

    async def check_departed(self, now: float) -> None:
        """One round of `take_departed` over every model. Other workers are judged only once this one has reached
        Redis for `ALIVE_S` without a break: while Redis was gone (a failover, a restart) every worker's mark may
        have expired, and each live worker sets its own again at its next heartbeat."""
        if self._reached_since is None:
            self._reached_since = now
        try:
            for model in list(self.intake.engines):
                await self.take_departed(model, judge_others=now - self._reached_since >= ALIVE_S)
        except QueueUnavailable as exc:
            self._reached_since = None
            log.warning("upkeep: queue unavailable", error=str(exc))

    async def take_departed(self, model: str, judge_others: bool = True) -> None:
        for stream in self.intake.streams(model):
            owners = await self.queue.consumers(stream)
            others = [name for name, n in owners.items() if n and name != self.consumer] if judge_others else []
            gone = await self._departed(others) if others and self._departed is not None else set()
            claims = [(g, DEPARTED_IDLE_S) for g in sorted(gone)]
            held = sum(1 for h in list(self.intake.held.values()) if h.stream == stream)
            if owners.get(self.consumer, 0) > held:  # it owns more than it holds: its predecessor's, or in flight
                claims.append((self.consumer, max(DEPARTED_IDLE_S, time.monotonic() - self._reading_since
                                                  + OWN_MARGIN_S)))
            for owner, min_idle in claims:
                room = self.intake.room_for(model)
                if room <= 0:
                    return
                claimed = await self.queue.reclaim(self.consumer, stream, min_idle, room, owner=owner)
                await self._take(model, stream, claimed, departed=owner)

    async def renew(self) -> int:
        by_stream: dict[str, list[bytes]] = {}
        for h in list(self.intake.held.values()):
            by_stream.setdefault(h.stream, []).append(h.entry_id)
        return await self.queue.renew(self.consumer, by_stream)

    async def reclaim(self, model: str) -> None:
        for stream in self.intake.streams(model):
            room = self.intake.room_for(model)
            if room <= 0:
                return
            claimed = await self.queue.reclaim(self.consumer, stream, self.settings.reclaim_idle_s, room)
            await self._take(model, stream, claimed)

    async def _take(self, model: str, stream: str, claimed: list[Entry], departed: str | None = None) -> None:
        if not claimed:
            return
        limit = self.settings.max_deliveries
        metrics.REDELIVERIES.labels(model).inc(len(claimed))
        poison = [c for c in claimed if c.deliveries > limit]
        if poison:
            await self.dead_letter(model, poison)
        keep = [c for c in claimed if c.deliveries <= limit]
        log.warning("reclaimed entries of a departed worker", model=model, stream=stream, count=len(keep),
                    dead_lettered=len(poison), departed=departed)
        if keep:
            await self.intake.accept(model, keep)

    async def dead_letter(self, model: str, poison: list[Entry]) -> None:
        """Entries that keep killing workers: dead-letter stream, and the request ends `failed`."""
        now = time.time()
        letters = []
        for c in poison:
            reason = (f"delivered {c.deliveries} times without finishing (each worker that held it died, or stopped "
                      f"answering for longer than the reclaim time: a request that crashes its workers)")
            try:
                req = decode_request(c)
            except (CodecError, KeyError):
                req = None
            failed = None
            if req is not None:
                out = failed_outcome(req, self.consumer, now, "poison_request", f"dead-lettered: {reason}")
                failed = Finished(req, out.result, None)
            letters.append(DeadLetter(c, reason, failed))
            metrics.DEAD_LETTERS.labels(model).inc()
            log.error("dead-lettered a poison request", model=model, request_id=req.id if req else None,
                      deliveries=c.deliveries)
        await self.queue.dead_letter(self.intake.keys.dead_letter(model), letters)
