"""The worker process: Redis I/O on asyncio, one compute thread (`ModelLoop`) per engine of each model
(a model's lanes form one or more engine groups; `gpu_worker.engines`).

    intake (XREADGROUP per model, XAUTOCLAIM of dead workers' entries)
        -> ModelLoop of the request's lane (pure scheduler + runner, on its thread)
        -> Publisher (result record + done event, then XACK + XDEL)

Invariant: every entry this worker reads is, at any moment, either held (renewed, so no live
worker's entry is ever taken) or acknowledged after its terminal record was written, or handed
back to the stream on shutdown; if the process dies, its entries are reclaimed by another worker
after `reclaim_idle_s`, and after `max_deliveries` they go to the dead-letter stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError, ResponseError

from gpu_worker import leases, metrics
from gpu_worker.assembly import load_engines
from gpu_worker.engines import ModelEngines
from gpu_worker.outcomes import Emitted, expired_outcome, failed_outcome
from gpu_worker.publisher import Held, Publisher
from shared.codec import decode, encode
from shared.config import ModelSpec, Settings
from shared.errors import CodecError
from shared.faults import Faults
from shared.keys import GROUP, Keys
from shared.messages import InferenceRequest
from shared.records import RecordStore
from shared.redis_io import UNAVAILABLE, make_redis, raise_if_cancelling, tolerate_outage
from shared.states import Status, Task

log = structlog.get_logger(__name__)

GATE_TIMEOUT_S = 2.0
HEARTBEAT_S = 2.0
MIN_INTAKE_BUFFER = 32
STATS_INTERVAL_S = 0.5
STATS_TTL_MS = 30_000
CLEANUP_EVERY = 10
INTAKE_STOP_TIMEOUT_S = 5.0  # maintenance cycles between consumer clean-ups


class Worker:
    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 loader: Callable[[ModelSpec], Any] | None = None, drain_budget_s: float | None = None,
                 intake_buffer: int | None = None, faults: Faults | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.name = settings.worker_name
        self.redis = redis or make_redis(settings.redis_url)
        self._own_redis = redis is None
        self.store = RecordStore(self.redis, self.keys, settings.result_ttl_s)
        self.faults = faults or Faults()
        self._loader = loader
        self.drain_budget_s = settings.drain_budget_s if drain_budget_s is None else drain_budget_s
        self._intake_buffer = intake_buffer
        self.engines: dict[str, ModelEngines] = {}
        self.held: dict[str, Held] = {}
        self._room = asyncio.Event()
        self.publisher = Publisher(self.redis, self.store, self.held, self.faults, self._room.set)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = asyncio.Event()
        self._crash = asyncio.Event()
        self._draining = False
        self._use_count = True

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        if self.faults.active:
            log.warning("fault injection is armed (BATCHGATE_FAULTS): a test run, not production")
        await self._load_models()
        await self._ensure_groups()
        await self._probe_blocking_count()
        for engines in self.engines.values():
            engines.start()
        intake = [asyncio.create_task(self._intake(name), name=f"intake-{name}") for name in self.engines]
        publisher = asyncio.create_task(self.publisher.run(), name="publisher")
        background = [
            asyncio.create_task(self._maintenance(), name="maintenance"),  # renews holds until the very end
            asyncio.create_task(self._cancel_listener(), name="cancels"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._publish_stats(), name="stats"),
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
        if self._own_redis:
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
        _, stuck = await asyncio.wait(intake, timeout=INTAKE_STOP_TIMEOUT_S)
        for task in stuck:  # never let a wedged Redis call hold up the drain
            log.warning("intake task did not stop in time", task=task.get_name(),
                        stack=[str(f) for f in task.get_stack(limit=8)])
        until = time.time() + self.drain_budget_s
        for engines in self.engines.values():
            engines.drain(until)
        await asyncio.to_thread(self._join_engines, self.drain_budget_s + 10)
        self.publisher.close()  # after the loops' last outcomes and hand-backs, which are already queued
        try:  # bounded: with Redis down, unwritten entries stay pending and are reclaimed later (safe)
            await asyncio.wait_for(publisher, timeout=self.drain_budget_s + 10)
        except TimeoutError:
            log.warning("drain: results not all written (redis unreachable?); their entries stay pending")

    async def _leave(self) -> None:
        with contextlib.suppress(ResponseError):
            async with tolerate_outage():
                await self.redis.hdel(self.keys.workers(), self.name)
                for name, engines in self.engines.items():
                    await self.redis.hdel(self.keys.lane_stats(name), *engines.stats_fields(self.name))
                await leases.leave(self.redis, self._all_streams(), self.name)

    def _join_engines(self, timeout: float) -> None:
        for engines in self.engines.values():
            engines.join(timeout)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A background task that ends by itself (not cancelled) leaves the worker unable to do its job:
        stop, so that a supervisor restarts it and other workers reclaim what it held."""
        if task.cancelled() or self._draining:
            return
        exc = task.exception()
        log.error("worker task ended unexpectedly", task=task.get_name(), error=repr(exc))
        self._crash.set()

    def _on_crash(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._crash.set)

    async def _load_models(self) -> None:
        self.engines = await load_engines(self.settings, worker=self.name, faults=self.faults, mark_running=self._gate,
                                          emit=self._emit, on_crash=self._on_crash, loader=self._loader)

    def _streams(self, model: str) -> list[str]:
        spec = self.settings.model(model)
        return self.keys.lane_streams(model, spec.lane_names) if spec else []

    def _all_streams(self) -> list[str]:
        return [s for model in self.engines for s in self._streams(model)]

    async def _ensure_groups(self) -> None:
        for stream in self._all_streams():
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _probe_blocking_count(self) -> None:
        """fakeredis answers XREADGROUP COUNT+BLOCK at once on an empty stream (RELIABILITY.md); on such a
        server read without COUNT, which it does block on, instead of spinning."""
        probe = f"{self.settings.key_prefix}:probe:{self.name}"
        try:
            await self.redis.xgroup_create(probe, GROUP, id="$", mkstream=True)
            t0 = time.monotonic()
            await self.redis.xreadgroup(GROUP, self.name, {probe: ">"}, count=1, block=200)
            self._use_count = time.monotonic() - t0 >= 0.1
        finally:
            await self.redis.delete(probe)
        if not self._use_count:
            log.warning("this Redis does not block on XREADGROUP with COUNT (fakeredis?): reading without COUNT")

    # --- thread -> asyncio bridges -------------------------------------------------------------
    def _emit(self, items: list[Emitted]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.publisher.queue.put_nowait, items)

    def _gate(self, reqs: list[InferenceRequest]) -> list[bool] | None:
        """From the model thread: mark requests running; False for those already terminal. None when Redis
        cannot tell (then nothing is computed: a cancelled request must never be)."""
        if self._loop is None:
            return [True] * len(reqs)
        try:
            fut = asyncio.run_coroutine_threadsafe(self.store.start(reqs, int(time.time() * 1000)), self._loop)
            states = fut.result(timeout=GATE_TIMEOUT_S)
        except Exception as exc:  # Redis unreachable, or the loop is shutting down
            log.warning("start gate unavailable; batch re-queued", error=repr(exc))
            return None
        return [s is Status.RUNNING for s in states]

    # --- intake --------------------------------------------------------------------------------
    def _room_for(self, model: str) -> int:
        spec = self.settings.model(model)
        if spec is None:
            return 0
        if self._intake_buffer is not None:
            limit = self._intake_buffer
        else:
            # enough to order by deadline and priority across a window of the stream; bounded so that
            # one worker does not hoard a burst that other workers could serve
            rows = spec.max_running if spec.task is Task.GENERATE else spec.max_batch_size
            limit = max(2 * rows + spec.max_batch_size, MIN_INTAKE_BUFFER)
        return limit - sum(1 for h in self.held.values() if h.model == model)

    async def _intake(self, model: str) -> None:
        streams = {s: ">" for s in self._streams(model)}
        backoff = 0.1
        while True:
            raise_if_cancelling()
            room = self._room_for(model)
            if room <= 0:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout=1.0)
                continue
            try:
                resp = await self.redis.xreadgroup(GROUP, self.name, streams, count=room if self._use_count else None,
                                                   block=self.settings.intake_block_ms)
                for stream, entries in _stream_items(resp or []):
                    await self._accept(model, stream, [(eid, fields) for eid, fields in entries])
                backoff = 0.1
            except (*UNAVAILABLE, RedisError) as exc:
                raise_if_cancelling(exc)
                if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                    # the stream is gone (Redis restarted empty, FLUSHDB): recreate the groups
                    with contextlib.suppress(*UNAVAILABLE, RedisError):
                        await self._ensure_groups()
                    continue
                log.warning("intake: redis error", model=model, error=repr(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _accept(self, model: str, stream: str, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        engines = self.engines[model]
        now = time.time()
        fresh: list[InferenceRequest] = []
        late: list[Emitted] = []
        for entry_id, fields in entries:
            req = await self._decode_entry(model, stream, entry_id, fields)
            if req is None:
                continue
            if req.id in self.held:  # a second entry for a request we already hold (a retried XADD, a hand-back)
                if self.held[req.id].entry_id != entry_id:
                    pipe = self.redis.pipeline(transaction=False)
                    pipe.xack(stream, GROUP, entry_id)
                    pipe.xdel(stream, entry_id)
                    await pipe.execute()
                continue
            self.held[req.id] = Held(model, stream, entry_id, req)
            if req.deadline_ms <= now * 1000 and engines.spec.deadline_aware:
                metrics.EXPIRED_BEFORE_COMPUTE.labels(model, req.lane).inc()
                late.append(expired_outcome(req, self.name, now, "before the worker read it"))
            else:
                fresh.append(req)
        if late:
            await self.publisher.queue.put(late)
        engines.submit(fresh, now)

    async def _decode_entry(self, model: str, stream: str, entry_id: bytes,
                            fields: dict[bytes, bytes]) -> InferenceRequest | None:
        try:
            return decode(fields[b"m"], InferenceRequest)
        except (CodecError, KeyError) as exc:
            log.error("undecodable stream entry: dead-lettered", stream=stream, entry=entry_id, error=str(exc))
            metrics.DEAD_LETTERS.labels(model).inc()
            pipe = self.redis.pipeline(transaction=False)
            leases.dead_letter_in(pipe, self.keys.dead_letter(model),
                                  leases.Claimed(stream, entry_id, fields, 1), f"undecodable: {exc}")
            await pipe.execute()
            return None

    # --- reclaim, renew, clean up --------------------------------------------------------------
    async def _maintenance(self) -> None:
        interval = max(0.1, self.settings.reclaim_idle_s / 3)
        cycle = 0
        while True:
            await asyncio.sleep(interval)
            raise_if_cancelling()  # a cancellation swallowed inside a Redis call still stops the loop
            cycle += 1
            try:
                await self._renew()
                for model in self.engines:
                    if not self._draining:
                        await self._reclaim(model)
                if cycle % CLEANUP_EVERY == 0:
                    idle_ms = int(2 * self.settings.reclaim_idle_s * 1000)
                    await leases.clean_consumers(self.redis, self._all_streams(), self.name, idle_ms)
            except (*UNAVAILABLE, RedisError) as exc:
                raise_if_cancelling(exc)
                log.warning("maintenance: redis error", error=repr(exc))

    async def _renew(self) -> None:
        by_stream: dict[str, list[bytes]] = {}
        for h in list(self.held.values()):
            by_stream.setdefault(h.stream, []).append(h.entry_id)
        await leases.renew(self.redis, self.name, by_stream)

    async def _reclaim(self, model: str) -> None:
        idle_ms = int(self.settings.reclaim_idle_s * 1000)
        for stream in self._streams(model):
            room = self._room_for(model)
            if room <= 0:
                return
            claimed = await leases.reclaim(self.redis, stream, self.name, idle_ms, room)
            if not claimed:
                continue
            metrics.REDELIVERIES.labels(model).inc(len(claimed))
            poison = [c for c in claimed if c.deliveries > self.settings.max_deliveries]
            if poison:
                await self._dead_letter(model, poison)
            keep = [(c.entry_id, c.fields) for c in claimed if c.deliveries <= self.settings.max_deliveries]
            log.warning("reclaimed entries of a departed worker", model=model, stream=stream, count=len(keep),
                        dead_lettered=len(poison))
            if keep:
                await self._accept(model, stream, keep)

    async def _dead_letter(self, model: str, poison: list[leases.Claimed]) -> None:
        """Entries that keep killing workers: dead-letter stream, and the request ends `failed`."""
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for c in poison:
            reason = f"delivered {c.deliveries} times without finishing (it crashed the workers that ran it)"
            try:
                req = decode(c.fields[b"m"], InferenceRequest)
            except (CodecError, KeyError):
                req = None
            if req is not None:
                out = failed_outcome(req, self.name, now, "poison_request", f"dead-lettered: {reason}")
                await self.store.finish_in(pipe, out.result, req.meta())
            leases.dead_letter_in(pipe, self.keys.dead_letter(model), c, reason)
            metrics.DEAD_LETTERS.labels(model).inc()
            log.error("dead-lettered a poison request", model=model, request_id=req.id if req else None,
                      deliveries=c.deliveries)
        await pipe.execute()

    # --- cancellations -------------------------------------------------------------------------
    async def _cancel_listener(self) -> None:
        channels = [self.keys.cancel_channel(m) for m in self.engines]
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*channels)
                while True:
                    msg = await pubsub.get_message(timeout=5.0)
                    if msg and msg.get("type") == "message":
                        self._cancel(msg["data"].decode())
            except UNAVAILABLE as exc:
                raise_if_cancelling(exc)
                log.warning("cancel listener: redis unavailable", error=repr(exc))
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _cancel(self, request_id: str) -> None:
        held = self.held.get(request_id)
        if held is not None:
            self.engines[held.model].cancel(request_id)

    # --- announcements -------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        """Announce this worker (models, time) every few seconds; `batchgate up` and ops tools read it.
        Entries of workers silent for a minute are removed."""
        while True:
            now = time.time()
            info = json.dumps({"models": list(self.engines), "at": now, "held": len(self.held)}).encode()
            async with tolerate_outage():
                await self.redis.hset(self.keys.workers(), self.name, info)
                for name, raw in (await self.redis.hgetall(self.keys.workers())).items():
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        if now - json.loads(raw)["at"] > 60:
                            await self.redis.hdel(self.keys.workers(), name)
            await asyncio.sleep(HEARTBEAT_S)

    async def _publish_stats(self) -> None:
        """Per-lane load and service figures for the gateway's admission control, at a steady interval."""
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for model, engines in self.engines.items():
                stats = engines.lane_stats(self.name)  # one field per engine: its own lanes, rows and costs
                if stats:
                    key = self.keys.lane_stats(model)
                    pipe.hset(key, mapping={field: encode(s) for field, s in stats.items()})
                    pipe.pexpire(key, STATS_TTL_MS)
            async with tolerate_outage():
                await pipe.execute()
            await asyncio.sleep(STATS_INTERVAL_S)


def _stream_items(resp: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP replies: a list of [stream, entries] (RESP2) or a dict (RESP3)."""
    items = resp.items() if isinstance(resp, dict) else resp
    out = []
    for stream, entries in items:
        name = stream.decode() if isinstance(stream, bytes) else stream
        out.append((name, [(eid, fields) for eid, fields in entries if fields]))
    return out
