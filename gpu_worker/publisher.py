"""Writes what the compute side emits through the queue port: outcomes (terminal record, then ack),
acks, hand-backs; then releases the requests from the worker's held entries.

Order is the invariant (see `gpu_worker.work_queue`): an entry is acknowledged only after its request's
terminal record exists. A crash between the two leaves the entry pending; whoever reclaims it finds the
record terminal and only acknowledges. An unavailable queue is retried with backoff until the writes
land: finishing is idempotent (first terminal write wins) and so is an ack; a step that landed is not
repeated (a hand-back queues a fresh entry, so it must not).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from gpu_worker import metrics
from gpu_worker.outcomes import Ack, Delta, Emitted, HandBack, Outcome
from gpu_worker.work_queue import Finished, Held, QueueUnavailable, WorkQueue
from shared.states import Status

log = structlog.get_logger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0


class Publisher:
    def __init__(self, queue: WorkQueue, held: dict[str, Held], on_released: Callable[[], None]) -> None:
        self.queue = queue
        self.held = held
        self._released = on_released
        self.inbox: asyncio.Queue[list[Emitted] | None] = asyncio.Queue()  # from the compute side, via the worker
        # the entries being handed back: a fresh entry of one of their requests, read meanwhile (by this worker's
        # intake, once room frees), is the request's new one, not a duplicate to drop
        self.leaving: set[bytes] = set()

    async def run(self) -> None:
        """Publish until `close()`; never cancelled mid-write (a cancelled hand-back would strand entries)."""
        while True:
            items = await self.inbox.get()
            closing = items is None
            batch: list[Emitted] = items or []
            while not self.inbox.empty():
                more = self.inbox.get_nowait()
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
        self.inbox.put_nowait(None)

    async def publish(self, items: list[Emitted]) -> None:
        handed = {h.entry_id for i in items if isinstance(i, HandBack)
                  for r in i.requests if (h := self.held.get(r.id)) is not None}
        self.leaving |= handed
        steps = self._steps(items)
        backoff = BACKOFF_START_S
        while steps:
            try:
                await steps[0]()
                steps.pop(0)
            except QueueUnavailable as exc:  # outage, OOM, READONLY after a failover: retry
                log.warning("publisher: queue unavailable, retrying", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        for item in items:
            if isinstance(item, Delta):
                continue  # the request is still running: nothing to release
            if isinstance(item, Outcome):
                observe(item)  # once, after the write landed (a retried write must not count twice)
            for req in (item.requests if isinstance(item, HandBack) else [item.request]):
                h = self.held.get(req.id)
                if h is not None and (not isinstance(item, HandBack) or h.entry_id in handed):
                    del self.held[req.id]  # not the fresh entry of a request handed back, if read meanwhile
        self.leaving -= handed
        self._released()

    def _steps(self, items: list[Emitted]) -> list[Callable[[], Awaitable[None]]]:
        """The writes `items` need, in order: streaming deltas, terminal records (then their acks), plain acks,
        hand-backs. Deltas first: a request's deltas are in its stream before its result is."""
        deltas = [(i.request.id, i.delta, i.first) for i in items if isinstance(i, Delta)]
        finished = [Finished(i.request, i.result, self.held.get(i.request.id)) for i in items if isinstance(i, Outcome)]
        acks = [h for i in items if isinstance(i, Ack) and (h := self.held.get(i.request.id)) is not None]
        back = [Held(h.model, h.stream, h.entry_id, req) for i in items if isinstance(i, HandBack)
                for req in i.requests if (h := self.held.get(req.id)) is not None]
        steps: list[Callable[[], Awaitable[None]]] = []
        if deltas:
            steps.append(lambda: self.queue.publish_deltas(deltas))
        if finished:
            steps.append(lambda: self.queue.complete(finished))
        if acks:
            steps.append(lambda: self.queue.ack(acks))
        if back:
            steps.append(lambda: self.queue.hand_back(back))
            log.info("handing back unfinished work", count=len(back))
        return steps


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
