"""Writing outcomes back to Redis: result record + done event first, then XACK + XDEL.

Order is the invariant: an entry is acknowledged only after its request's terminal record exists.
A crash between the two leaves the entry pending; whoever reclaims it finds the record terminal and
only acknowledges. Redis errors are retried with backoff until the write lands: finishing is
idempotent (first terminal write wins) and so is XACK.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from gpu_worker import metrics
from gpu_worker.outcomes import Ack, Emitted, HandBack, Outcome
from shared.codec import encode
from shared.faults import Faults
from shared.keys import GROUP
from shared.messages import InferenceRequest
from shared.records import RecordStore
from shared.redis_io import UNAVAILABLE, raise_if_cancelling
from shared.states import Status

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Held:
    """A stream entry this worker read and has not acknowledged yet."""

    model: str
    stream: str
    entry_id: bytes
    request: InferenceRequest


class Publisher:
    def __init__(self, redis: aioredis.Redis, store: RecordStore, held: dict[str, Held], faults: Faults,
                 on_released: Callable[[], None]) -> None:
        self.redis = redis
        self.store = store
        self.held = held
        self.faults = faults
        self._released = on_released
        self.queue: asyncio.Queue[list[Emitted] | None] = asyncio.Queue()

    async def run(self) -> None:
        """Publish until `close()`; never cancelled mid-write (a cancelled hand-back would strand entries)."""
        while True:
            items = await self.queue.get()
            closing = items is None
            batch: list[Emitted] = items or []
            while not self.queue.empty():
                more = self.queue.get_nowait()
                if more is None:
                    closing = True
                else:
                    batch.extend(more)
            if batch:
                await self.publish(batch)
            if closing:
                return

    def close(self) -> None:
        """Ask `run` to return once everything queued before this call is written."""
        self.queue.put_nowait(None)

    async def publish(self, items: list[Emitted]) -> None:
        backoff = 0.05
        while True:
            try:
                await self._write(items)
                break
            except (*UNAVAILABLE, RedisError) as exc:  # outage, OOM, READONLY after a failover: retry
                raise_if_cancelling(exc)
                log.warning("publisher: redis error, retrying", error=repr(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        for item in items:
            if isinstance(item, Outcome):
                observe(item)  # once, after the write landed (a retried write must not count twice)
            for req in (item.requests if isinstance(item, HandBack) else [item.request]):
                self.held.pop(req.id, None)
        self._released()

    async def _write(self, items: list[Emitted]) -> None:
        results = [i for i in items if isinstance(i, Outcome)]
        if results:
            pipe = self.redis.pipeline(transaction=False)
            for o in results:
                await self.store.finish_in(pipe, o.result, o.request.meta())
            await pipe.execute()
            self.faults.point("kill_after_result_write")
        pipe = self.redis.pipeline(transaction=False)
        acks: dict[str, list[bytes]] = {}
        for item in items:
            if isinstance(item, HandBack):
                self._hand_back_in(pipe, item)
                continue
            held = self.held.get(item.request.id)
            if held is not None and isinstance(item, Outcome | Ack):
                acks.setdefault(held.stream, []).append(held.entry_id)
        for stream, ids in acks.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
        for o in results:  # no longer counts against its tenant's backlog quota
            pipe.zrem(self.store.keys.tenant_active(o.request.tenant), o.request.id)
        if len(pipe):
            await pipe.execute()
            self.faults.point("kill_after_ack")

    def _hand_back_in(self, pipe: aioredis.client.Pipeline, item: HandBack) -> None:
        """Re-queue unfinished work as fresh entries, then drop ours: another worker takes it at once,
        without waiting for the reclaim threshold."""
        for req in item.requests:
            held = self.held.get(req.id)
            if held is None:
                continue
            pipe.xadd(held.stream, {"m": encode(req)})
            pipe.xack(held.stream, GROUP, held.entry_id)
            pipe.xdel(held.stream, held.entry_id)
        if item.requests:
            log.info("handed back unfinished work", count=len(item.requests))


def observe(o: Outcome) -> None:
    model = o.request.model
    status = o.result.status
    metrics.RESULTS.labels(model, status.value).inc()
    t = o.result.timings
    if "compute_ms" in t:
        metrics.COMPUTE.labels(model).observe(t["compute_ms"] / 1000)
    if "ttft_ms" in t:
        metrics.TTFT.labels(model).observe(t["ttft_ms"] / 1000)
    if o.result.output and "completion_tokens" in o.result.output:
        metrics.TOKENS.labels(model).inc(o.result.output["completion_tokens"])
    if status is Status.EXPIRED and o.computed:
        metrics.DEADLINE_MISSES.labels(model, o.request.lane).inc()
    log.info("request finished", request_id=o.request.id, model=model, lane=o.request.lane,
             status=status.value, finish_reason=o.result.finish_reason, **t)
