"""Upkeep of stream ownership, on a steady interval (a third of the reclaim idle time):
- renew every entry this worker holds, so that no live worker's entry is ever reclaimed;
- reclaim entries idle past `reclaim_idle_s` (their worker died or hung) while not draining; one
  delivered more than `max_deliveries` times keeps killing workers: it is dead-lettered and its
  request ends `failed`;
- now and then, delete consumers of departed workers that own nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from gpu_worker import metrics
from gpu_worker.intake import Intake
from gpu_worker.outcomes import failed_outcome
from gpu_worker.work_queue import DeadLetter, Entry, Finished, QueueUnavailable, decode_request
from shared.errors import CodecError
from shared.redis_io import raise_if_cancelling

log = structlog.get_logger(__name__)

CLEANUP_EVERY = 10  # upkeep cycles between consumer clean-ups
MIN_INTERVAL_S = 0.1


class Upkeep:
    def __init__(self, intake: Intake, draining: Callable[[], bool]) -> None:
        self.intake = intake
        self.queue = intake.queue
        self.settings = intake.settings
        self.consumer = intake.consumer
        self._draining = draining

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

    async def renew(self) -> int:
        by_stream: dict[str, list[bytes]] = {}
        for h in list(self.intake.held.values()):
            by_stream.setdefault(h.stream, []).append(h.entry_id)
        return await self.queue.renew(self.consumer, by_stream)

    async def reclaim(self, model: str) -> None:
        limit = self.settings.max_deliveries
        for stream in self.intake.streams(model):
            room = self.intake.room_for(model)
            if room <= 0:
                return
            claimed = await self.queue.reclaim(self.consumer, stream, self.settings.reclaim_idle_s, room)
            if not claimed:
                continue
            metrics.REDELIVERIES.labels(model).inc(len(claimed))
            poison = [c for c in claimed if c.deliveries > limit]
            if poison:
                await self.dead_letter(model, poison)
            keep = [c for c in claimed if c.deliveries <= limit]
            log.warning("reclaimed entries of a departed worker", model=model, stream=stream, count=len(keep),
                        dead_lettered=len(poison))
            if keep:
                await self.intake.accept(model, keep)

    async def dead_letter(self, model: str, poison: list[Entry]) -> None:
        """Entries that keep killing workers: dead-letter stream, and the request ends `failed`."""
        now = time.time()
        letters = []
        for c in poison:
            reason = f"delivered {c.deliveries} times without finishing (it crashed the workers that ran it)"
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
