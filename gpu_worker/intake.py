"""Intake: new entries of a model's lane streams, read while there is room, decoded once, handed to the
model's engines. Every entry read becomes held (until the publisher releases it) or is settled at once:
a duplicate of a held request is acked, an undecodable entry is dead-lettered, a request already past
its deadline ends `expired` without reaching the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import structlog

from gpu_worker import metrics
from gpu_worker.outcomes import Emitted, expired_outcome
from gpu_worker.work_queue import DeadLetter, Entry, Held, QueueUnavailable, WorkQueue, decode_request
from shared.config import Settings
from shared.deadlines import cannot_finish
from shared.errors import CodecError
from shared.keys import Keys
from shared.messages import InferenceRequest
from shared.redis_io import raise_if_cancelling
from shared.states import Task

if TYPE_CHECKING:
    from gpu_worker.engines import ModelEngines

log = structlog.get_logger(__name__)

MIN_INTAKE_BUFFER = 32
ROOM_WAIT_S = 1.0
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
POLL_S = 0.05  # how often a worker that holds more than it can start polls the streams while a peer has idle rows


class Intake:
    def __init__(self, settings: Settings, queue: WorkQueue, consumer: str, engines: dict[str, ModelEngines],
                 held: dict[str, Held], room: asyncio.Event, publish: Callable[[list[Emitted]], Awaitable[None]],
                 buffer: int | None = None, leaving: set[bytes] | None = None) -> None:
        self.settings = settings
        self.queue = queue
        self.consumer = consumer
        self.keys = Keys(settings.key_prefix)
        self.engines = engines
        self.held = held
        self.room = room  # set by the publisher whenever it releases held entries
        self._publish = publish
        self._buffer = buffer
        self.leaving = leaving if leaving is not None else set()  # `Publisher.leaving`
        # by model: another worker has idle rows (set by `gpu_worker.rebalance`). While this worker holds more than it
        # can start, it then polls the streams instead of waiting on them: what it hands back to that worker goes to
        # it (it waits on them), not to a read of its own in flight (without this, this worker took back 5 to 35 of
        # a 40-request burst's). Otherwise every worker waits on the streams, and new work goes to the one waiting
        # longest, as it always did (polling while the peer merely had little waiting sent it every interactive
        # arrival of a burst, more than it could start, and they expired: an outside probe)
        self.peer_room: dict[str, bool] = {}
        # models with a blocking read in flight (up to `intake_block_ms`): one that began before the intake polled is
        # served a hand-back first (it blocked before the peer), so the rebalance loop waits until it has returned
        self.blocking: set[str] = set()

    def streams(self, model: str) -> list[str]:
        spec = self.settings.model(model)
        return self.keys.lane_streams(model, spec.lane_names) if spec else []

    def room_for(self, model: str) -> int:
        """How many more entries of `model` this worker may hold."""
        spec = self.settings.model(model)
        if spec is None:
            return 0
        if self._buffer is not None:
            limit = self._buffer
        else:
            # enough to order by deadline and priority across a window of the stream; bounded so that
            # one worker does not hoard a burst that other workers could serve
            rows = spec.max_running if spec.task is Task.GENERATE else spec.max_batch_size
            limit = max(2 * rows + spec.max_batch_size, MIN_INTAKE_BUFFER)
        return limit - sum(1 for h in self.held.values() if h.model == model)

    async def run(self, model: str) -> None:
        """Read `model`'s streams until cancelled; an unavailable queue is retried with backoff."""
        streams = self.streams(model)
        block_s = self.settings.intake_block_ms / 1000
        backoff = BACKOFF_START_S
        while True:
            raise_if_cancelling()
            room = self.room_for(model)
            if room <= 0:
                self.room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.room.wait(), timeout=ROOM_WAIT_S)
                continue
            try:
                polling = self.peer_room.get(model, False) and self.loaded(model)
                if not polling:
                    self.blocking.add(model)
                try:
                    entries = await self.queue.read(self.consumer, streams, room, 0.0 if polling else block_s)
                finally:
                    self.blocking.discard(model)
                await self.accept(model, entries)
                backoff = BACKOFF_START_S
                if polling and not entries:
                    await asyncio.sleep(POLL_S)
            except QueueUnavailable as exc:
                log.warning("intake: queue unavailable", model=model, error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def loaded(self, model: str) -> bool:
        """Some engine of `model` has more waiting than free rows (read across threads: counts only)."""
        return any(len(loop.scheduler) > loop.runner.free_rows for loop in self.engines[model])

    async def accept(self, model: str, entries: list[Entry]) -> None:
        """Hold `entries` (read or reclaimed) and submit their requests to the model's engines."""
        engines = self.engines[model]
        now = time.time()
        fresh: list[InferenceRequest] = []
        late: list[Emitted] = []
        for entry in entries:
            req = await self._decode(model, entry)
            if req is None:
                continue
            held = self.held.get(req.id)
            if held is not None and held.entry_id in self.leaving:
                held = None  # being handed back (to a less loaded worker) and read here again: this entry is its own
            if held is not None:  # a second entry for a request we already hold (a retried XADD)
                if held.entry_id != entry.id:
                    await self.queue.ack([Held(model, entry.stream, entry.id, req)])
                continue
            self.held[req.id] = Held(model, entry.stream, entry.id, req)
            if engines.spec.deadline_aware and cannot_finish(req.deadline_ms / 1000, now):
                metrics.EXPIRED_BEFORE_COMPUTE.labels(model, req.lane).inc()
                late.append(expired_outcome(req, self.consumer, now, "before the worker read it"))
            else:
                fresh.append(req)
        if late:
            await self._publish(late)
        engines.submit(await self._resumed(fresh), now)

    async def _resumed(self, requests: list[InferenceRequest]) -> list[InferenceRequest]:
        """Streaming requests an earlier attempt already sent tokens of (a crash, a hand-back) continue after
        them: their callers never see a token twice or a different one."""
        ids = [req.id for req in requests if req.stream]
        if not ids:
            return requests
        sent = await self.queue.streamed(ids)
        return [dataclasses.replace(req, streamed=sent[req.id]) if req.id in sent else req for req in requests]

    async def _decode(self, model: str, entry: Entry) -> InferenceRequest | None:
        try:
            return decode_request(entry)
        except (CodecError, KeyError) as exc:
            log.error("undecodable stream entry: dead-lettered", stream=entry.stream, entry=entry.id, error=str(exc))
            metrics.DEAD_LETTERS.labels(model).inc()
            await self.queue.dead_letter(self.keys.dead_letter(model), [DeadLetter(entry, f"undecodable: {exc}")])
            return None
