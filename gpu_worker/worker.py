"""The worker process: queue I/O on asyncio, the compute side on threads (a `ModelEngines` per model).

    intake (read per model; upkeep reclaims dead workers' entries)        gpu_worker.intake, .upkeep
        -> the model's engines (scheduler + runner, on their threads)     gpu_worker.engines
        -> publisher (terminal record, then ack; or hand back)            gpu_worker.publisher
    heartbeat, load figures, cancellations                                gpu_worker.announce

Every queue operation goes through the port in `gpu_worker.work_queue` (its invariant is written
there): `RedisQueue` in production, `MemoryQueue` in tests. The worker keeps its side of it: every
entry it reads is, at any moment, held (and renewed), or released after the publisher wrote its
outcome, or handed back on shutdown; if the process dies, its entries are reclaimed by another worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import structlog

from gpu_worker.announce import (
    Announcer,
    RedisAnnouncer,
    beat,
    cancel_loop,
    heartbeat_loop,
    stats_loop,
    wait_for_unique_name,
)
from gpu_worker.intake import Intake
from gpu_worker.outcomes import Emitted
from gpu_worker.publisher import Publisher
from gpu_worker.rebalance import rebalance_loop
from gpu_worker.upkeep import Upkeep
from gpu_worker.work_queue import Held, QueueUnavailable, WorkQueue
from shared.config import ModelSpec, Settings
from shared.faults import Faults
from shared.heap import freeze_startup_heap, thaw_heap
from shared.keys import Keys
from shared.messages import InferenceRequest

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from gpu_worker.engines import ModelEngines

log = structlog.get_logger(__name__)

MARK_RUNNING_TIMEOUT_S = 2.0
INTAKE_STOP_TIMEOUT_S = 5.0
JOIN_SLACK_S = 10.0  # beyond the drain budget: for the engines' last outcomes and their writes

# async (settings, *, worker, faults, mark_running, emit, on_crash, loader) -> {model: ModelEngines}
EnginesFactory = Callable[..., Awaitable[dict[str, "ModelEngines"]]]


class Worker:
    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 loader: Callable[[ModelSpec], Any] | None = None, drain_budget_s: float | None = None,
                 intake_buffer: int | None = None, faults: Faults | None = None, queue: WorkQueue | None = None,
                 announcer: Announcer | None = None, engines_factory: EnginesFactory | None = None) -> None:
        """`queue`, `announcer` and `engines_factory` replace Redis and the models (tests: `MemoryQueue`,
        `MemoryAnnouncer` and fake engines); by default both talk to `redis` (made from the settings)."""
        self.settings = settings
        self.name = settings.worker_name
        self.instance = secrets.token_hex(6)  # this process: tells its own heartbeats from another's of its name
        self.faults = faults or Faults()
        self.redis = redis
        self._own_redis = False
        if queue is None or announcer is None:
            self.redis, self._own_redis = self._redis(redis)
        self.queue = queue or self._redis_queue()
        self.announcer = announcer or RedisAnnouncer(self.redis, Keys(settings.key_prefix))
        self._loader = loader
        self._engines_factory = engines_factory
        self.drain_budget_s = settings.drain_budget_s if drain_budget_s is None else drain_budget_s
        self.engines: dict[str, ModelEngines] = {}
        self.held: dict[str, Held] = {}
        self._room = asyncio.Event()
        self.publisher = Publisher(self.queue, self.held, self._room.set)
        self.intake = Intake(settings, self.queue, self.name, self.engines, self.held, self._room,
                             self.publisher.inbox.put, intake_buffer, self.publisher.leaving)
        self.upkeep = Upkeep(self.intake, lambda: self._draining, self.announcer.departed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = asyncio.Event()
        self._crash = asyncio.Event()
        self._draining = False

    def _redis(self, redis: aioredis.Redis | None) -> tuple[aioredis.Redis, bool]:
        if redis is not None:
            return redis, False
        from shared.redis_io import make_redis

        return make_redis(self.settings.redis_url), True

    def _redis_queue(self) -> WorkQueue:
        from gpu_worker.redis_queue import RedisQueue
        from shared.records import RecordStore

        keys = Keys(self.settings.key_prefix)
        return RedisQueue(self.redis, keys, RecordStore(self.redis, keys, self.settings.result_ttl_s,
                                                     wait_replicas=self.settings.redis_wait_replicas,
                                                     wait_ms=self.settings.redis_wait_ms), self.faults,
                          self.settings.expiry_grace_s)

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Start, serve until `stop` (or a crash), drain, leave."""
        try:
            await self._run(stop)
        finally:
            thaw_heap()  # stopped: what start-up froze can be freed (a test process runs many workers)

    async def _run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        if self.faults.active:
            log.warning("fault injection is armed (BATCHGATE_FAULTS): a test run, not production")
        await self._load_models()
        log.info("start-up heap frozen", objects=freeze_startup_heap())  # the models' objects: out of collections
        from shared.redis_io import until_reachable

        grouped, _ = await until_reachable(lambda: self.queue.create_groups(self._all_streams()), stop, "worker", log,
                                           errors=(QueueUnavailable,))
        if not grouped:  # stopped while waiting for Redis: nothing was taken
            if self._own_redis and self.redis is not None:
                await self.redis.aclose()
            log.info("worker stopped before Redis answered", worker=self.name)
            return
        if not await self._unique_name(stop):
            return
        await beat(self.announcer, self.name, self._heartbeat_info)  # its liveness mark lands before any read
        self.upkeep.begin()
        for engines in self.engines.values():
            engines.start()
        intake = [asyncio.create_task(self.intake.run(name), name=f"intake-{name}") for name in self.engines]
        publisher = asyncio.create_task(self.publisher.run(), name="publisher")
        background = [
            asyncio.create_task(self.upkeep.run(), name="upkeep"),  # renews holds until the very end
            asyncio.create_task(self.upkeep.watch(), name="departed"),
            asyncio.create_task(cancel_loop(self.announcer, list(self.engines), self.cancel), name="cancels"),
            asyncio.create_task(heartbeat_loop(self.announcer, self.name, self._heartbeat_info), name="heartbeat"),
            asyncio.create_task(stats_loop(self.announcer, self._lane_stats), name="stats"),
            asyncio.create_task(
                rebalance_loop(self.engines, self.name, self.announcer.peer_stats, self.intake.peer_room,
                               blocking=self.intake.blocking),
                name="rebalance"),
        ]
        for task in [*intake, publisher, *background]:
            task.add_done_callback(self._task_ended)
        self.ready.set()
        log.info("worker ready", worker=self.name, models=list(self.engines))
        stopper = asyncio.create_task(stop.wait())
        crashed = asyncio.create_task(self._crash.wait())
        await asyncio.wait([stopper, crashed], return_when=asyncio.FIRST_COMPLETED)
        await self._drain(intake, publisher)
        for task in [*background, stopper, crashed]:
            task.cancel()
        await asyncio.gather(*background, stopper, crashed, return_exceptions=True)
        await self._leave()
        if self._own_redis and self.redis is not None:
            await self.redis.aclose()
        log.info("worker stopped", worker=self.name, still_held=len(self.held))
        if self._crash.is_set():
            bad = [c for engines in self.engines.values() for c in engines.crashed]
            raise RuntimeError(f"model loop crashed ({'; '.join(bad)})")

    async def _drain(self, intake: list[asyncio.Task[None]], publisher: asyncio.Task[None]) -> None:
        """Stop intake at once; let running work finish within the budget; hand back the rest."""
        log.info("worker draining", worker=self.name, budget_s=self.drain_budget_s, held=len(self.held))
        self._draining = True
        for task in intake:
            task.cancel()
        _, stuck = await asyncio.wait(intake, timeout=INTAKE_STOP_TIMEOUT_S) if intake else ((), ())
        for task in stuck:  # never let a wedged queue call hold up the drain
            log.warning("intake task did not stop in time", task=task.get_name(),
                        stack=[str(f) for f in task.get_stack(limit=8)])
        until = time.time() + self.drain_budget_s
        for engines in self.engines.values():
            engines.drain(until)
        await asyncio.to_thread(self._join_engines, self.drain_budget_s + JOIN_SLACK_S)
        self.publisher.close()  # after the engines' last outcomes and hand-backs, which are already queued
        try:  # bounded: with the queue down, unwritten entries stay pending and are reclaimed later (safe)
            await asyncio.wait_for(publisher, timeout=self.drain_budget_s + JOIN_SLACK_S)
        except TimeoutError:
            log.warning("drain: results not all written (queue unreachable?); their entries stay pending")

    async def _leave(self) -> None:
        fields = {name: engines.stats_fields(self.name) for name, engines in self.engines.items()}
        await self.announcer.withdraw(self.name, fields)
        try:
            await self.queue.leave(self.name, self._all_streams())
        except QueueUnavailable as exc:
            log.warning("leave: queue unavailable; the consumer is cleaned up later", error=str(exc))

    def _join_engines(self, timeout: float) -> None:
        for engines in self.engines.values():
            engines.join(timeout)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A background task that ends by itself (not cancelled) leaves the worker unable to do its job:
        stop, so that a supervisor restarts it and other workers reclaim what it held."""
        if task.cancelled() or self._draining:
            return
        log.error("worker task ended unexpectedly", task=task.get_name(), error=repr(task.exception()))
        self._crash.set()

    async def _load_models(self) -> None:
        factory = self._engines_factory
        if factory is None:
            from gpu_worker.assembly import load_engines  # the compute side (torch) loads only here

            factory = load_engines
        loaded = await factory(self.settings, worker=self.name, faults=self.faults, mark_running=self.mark_running,
                               emit=self.emit, on_crash=self.on_crash, loader=self._loader)
        self.engines.clear()
        self.engines.update(loaded)  # the same dict the intake reads

    def _all_streams(self) -> list[str]:
        return [s for model in self.engines for s in self.intake.streams(model)]

    # --- announcements -------------------------------------------------------------------------
    async def _unique_name(self, stop: asyncio.Event) -> bool:
        from shared.redis_io import UNAVAILABLE

        try:
            unique = await wait_for_unique_name(self.announcer, self.name, self.instance, stop)
        except UNAVAILABLE as exc:  # Redis gone again: the heartbeat's own outage handling takes over
            log.warning("worker name check: redis unavailable", error=repr(exc))
            unique = not stop.is_set()
        if not unique:
            if self._own_redis and self.redis is not None:
                await self.redis.aclose()
            log.info("worker stopped before it started", worker=self.name)
        return unique

    def _heartbeat_info(self) -> dict[str, Any]:
        return {"instance": self.instance, "models": list(self.engines), "held": len(self.held)}

    def _lane_stats(self) -> dict[str, Any]:
        # one field per engine: its own lanes, rows and costs; a draining worker starts nothing more: no row is free
        stats = {model: engines.lane_stats(self.name) for model, engines in self.engines.items()}
        if self._draining:
            return {m: {f: dataclasses.replace(s, free_rows=0) for f, s in fs.items()} for m, fs in stats.items()}
        return stats

    def cancel(self, request_id: str) -> None:
        held = self.held.get(request_id)
        if held is not None:
            self.engines[held.model].cancel(request_id)

    # --- called from the compute threads -------------------------------------------------------
    def emit(self, items: list[Emitted]) -> None:
        """Outcomes, acks and hand-backs, to the publisher."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.publisher.inbox.put_nowait, items)

    def mark_running(self, reqs: list[InferenceRequest]) -> list[bool] | None:
        """The start gate: mark requests running; False for those already terminal (done or cancelled).
        None when the queue cannot tell: then nothing is computed (a cancelled request must never be)."""
        if self._loop is None:
            return [True] * len(reqs)
        try:
            fut = asyncio.run_coroutine_threadsafe(self.queue.mark_running(reqs, int(time.time() * 1000)), self._loop)
            return fut.result(timeout=MARK_RUNNING_TIMEOUT_S)
        except Exception as exc:  # unreachable, or the loop is shutting down
            log.warning("start gate unavailable; batch re-queued", error=repr(exc))
            return None

    def on_crash(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._crash.set)
