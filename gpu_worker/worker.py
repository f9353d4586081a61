"""The worker process: Redis I/O on asyncio, one compute thread (`ModelLoop`) per model.

    intake (XREADGROUP per model) -> ModelLoop (scheduler + runner) -> publisher (finish + XACK/XDEL)

Invariant: a stream entry is acknowledged only after its request's terminal record is written (or
found already terminal), in the same ordered pipeline; everything read but not finished is either
handed back to the stream on shutdown or left pending for another worker to reclaim.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from gpu_worker import metrics
from gpu_worker.model_loop import Add, Cancel, Drain, Emitted, HandBack, ModelLoop, Snapshot
from gpu_worker.runners import EmbedRunner, GenerateRunner, Outcome, Runner, expired_outcome, size_engine
from gpu_worker.scheduler import BatchLimits, LanePolicy, Scheduler
from shared.codec import decode, encode
from shared.config import ModelSpec, Settings
from shared.errors import CodecError
from shared.keys import GROUP, Keys
from shared.messages import InferenceRequest, LaneStat, LaneStats
from shared.records import RecordStore
from shared.redis_io import UNAVAILABLE, make_redis
from shared.states import Status, Task

log = structlog.get_logger(__name__)

GATE_TIMEOUT_S = 2.0
HEARTBEAT_S = 2.0
MIN_INTAKE_BUFFER = 32
STATS_INTERVAL_S = 0.5
STATS_TTL_MS = 30_000


@dataclass(slots=True)
class Held:
    model: str
    stream: str
    entry_id: bytes
    request: InferenceRequest


def build_runner(loaded: Any, worker: str) -> Runner:
    spec: ModelSpec = loaded.spec
    if spec.task is Task.EMBED:
        return EmbedRunner(loaded, worker)
    rows, max_seq_len = size_engine(loaded)
    return GenerateRunner(loaded, worker, max_rows=rows, max_seq_len=max_seq_len)


def build_scheduler(spec: ModelSpec) -> Scheduler:
    return Scheduler([LanePolicy(lane.name, lane.window_ms / 1000) for lane in spec.lanes],
                     BatchLimits(spec.max_batch_size, spec.max_batch_tokens), deadline_aware=spec.deadline_aware)


def lane_stats(spec: ModelSpec, worker: str, snap: Snapshot) -> LaneStats:
    return LaneStats(
        model=spec.name, worker=worker, at_ms=int(snap.at * 1000), max_rows=snap.max_rows,
        free_rows=snap.free_rows, deadline_aware=spec.deadline_aware, prefill_fixed_ms=snap.prefill_fixed_ms,
        prefill_ms_per_token=snap.prefill_ms_per_token, decode_ms_per_step=snap.decode_ms_per_step,
        lanes=tuple(LaneStat(lane, load.waiting, load.running, load.completed_rps, load.est_wait_ms)
                    for lane, load in snap.lanes.items()),
    )


class Worker:
    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 loader: Callable[[ModelSpec], Any] | None = None, drain_budget_s: float = 30.0,
                 intake_buffer: int | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.name = settings.worker_name
        self.redis = redis or make_redis(settings.redis_url)
        self._own_redis = redis is None
        self.store = RecordStore(self.redis, self.keys, settings.result_ttl_s)
        self._loader = loader
        self.drain_budget_s = drain_budget_s
        self._intake_buffer = intake_buffer
        self.loops: dict[str, ModelLoop] = {}
        self.held: dict[str, Held] = {}
        self._out: asyncio.Queue[list[Emitted]] = asyncio.Queue()
        self._room = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = asyncio.Event()
        self._crash = asyncio.Event()
        self._use_count = True

    # --- lifecycle -----------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        await self._load_models()
        await self._ensure_groups()
        await self._probe_blocking_count()
        for lp in self.loops.values():
            lp.start()
        intake = [asyncio.create_task(self._intake(name), name=f"intake-{name}") for name in self.loops]
        publisher = asyncio.create_task(self._publisher(), name="publisher")
        cancels = asyncio.create_task(self._cancel_listener(), name="cancels")
        heartbeat = asyncio.create_task(self._heartbeat(), name="heartbeat")
        stats = asyncio.create_task(self._publish_stats(), name="stats")
        self.ready.set()
        log.info("worker ready", worker=self.name, models=list(self.loops))
        stopper = asyncio.create_task(stop.wait())
        crashed = asyncio.create_task(self._watch_loops())
        await asyncio.wait([stopper, crashed], return_when=asyncio.FIRST_COMPLETED)
        log.info("worker draining", worker=self.name, budget_s=self.drain_budget_s)
        for task in intake:
            task.cancel()
        await asyncio.gather(*intake, return_exceptions=True)
        until = time.time() + self.drain_budget_s
        for lp in self.loops.values():
            lp.submit(Drain(until))
        await asyncio.to_thread(self._join_loops, self.drain_budget_s + 10)
        await self._flush()
        background = (publisher, cancels, heartbeat, stats, stopper, crashed)
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        with contextlib.suppress(*UNAVAILABLE):
            await self.redis.hdel(self.keys.workers(), self.name)
            for name in self.loops:
                await self.redis.hdel(self.keys.lane_stats(name), self.name)
        if self._own_redis:
            await self.redis.aclose()
        log.info("worker stopped", worker=self.name, still_held=len(self.held))
        if self._crash.is_set():
            raise RuntimeError("a model loop crashed; see the log above")

    async def _heartbeat(self) -> None:
        """Announce this worker (models, time) every few seconds; `batchgate up` and ops tools read it."""
        while True:
            info = json.dumps({"models": list(self.loops), "at": time.time(),
                               "held": len(self.held)}).encode()
            with contextlib.suppress(*UNAVAILABLE):
                await self.redis.hset(self.keys.workers(), self.name, info)
            await asyncio.sleep(HEARTBEAT_S)

    async def _publish_stats(self) -> None:
        """Per-lane load and service figures for the gateway's admission control, at a steady interval."""
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for name, lp in self.loops.items():
                spec = self.settings.model(name)
                if spec is None or not lp.snapshot.at:
                    continue
                key = self.keys.lane_stats(name)
                pipe.hset(key, self.name, encode(lane_stats(spec, self.name, lp.snapshot)))
                pipe.pexpire(key, STATS_TTL_MS)
            with contextlib.suppress(*UNAVAILABLE):
                await pipe.execute()
            await asyncio.sleep(STATS_INTERVAL_S)

    def _join_loops(self, timeout: float) -> None:
        for lp in self.loops.values():
            lp.join(timeout)

    async def _watch_loops(self) -> None:
        await self._crash.wait()
        bad = [f"{lp.name}: {lp.crashed!r}" for lp in self.loops.values() if lp.crashed is not None]
        raise RuntimeError(f"model loop crashed ({'; '.join(bad)})")

    def _on_crash(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._crash.set)

    async def _load_models(self) -> None:
        from gpu_worker import models

        for spec in self.settings.models:
            if self._loader is not None:
                loaded = await asyncio.to_thread(self._loader, spec)
            else:
                loaded = await asyncio.to_thread(models.load, spec, self.settings.model_cache_dir)
            runner = build_runner(loaded, self.name)
            self.loops[spec.name] = ModelLoop(spec.name, runner, build_scheduler(spec), gate=self._gate,
                                              emit=self._emit, on_crash=self._on_crash, worker=self.name)

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

    async def _ensure_groups(self) -> None:
        for spec in self.settings.models:
            for stream in self.keys.lane_streams(spec.name, spec.lane_names):
                try:
                    await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
                except ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    # --- thread -> asyncio bridges -------------------------------------------------------------
    def _emit(self, items: list[Emitted]) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._out.put_nowait, items)

    def _gate(self, reqs: list[InferenceRequest]) -> list[bool]:
        """From the model thread: mark requests running; False for those already terminal."""
        if self._loop is None:
            return [True] * len(reqs)
        fut = asyncio.run_coroutine_threadsafe(self.store.start(reqs, int(time.time() * 1000)), self._loop)
        try:
            states = fut.result(timeout=GATE_TIMEOUT_S)
        except Exception as exc:
            log.warning("start gate unavailable", error=repr(exc))
            return [True] * len(reqs)
        return [s is Status.RUNNING for s in states]

    # --- intake --------------------------------------------------------------------------------
    def _buffer_limit(self, spec: ModelSpec) -> int:
        if self._intake_buffer is not None:
            return self._intake_buffer
        # Enough to order by deadline and priority across a window of the stream; bounded so that one
        # worker does not hoard a burst that other workers could serve.
        rows = spec.max_running if spec.task is Task.GENERATE else spec.max_batch_size
        return max(2 * rows + spec.max_batch_size, MIN_INTAKE_BUFFER)

    async def _intake(self, model: str) -> None:
        spec = self.settings.model(model)
        if spec is None:
            return
        lp = self.loops[model]
        streams = {s: ">" for s in self.keys.lane_streams(model, spec.lane_names)}
        limit = self._buffer_limit(spec)
        backoff = 0.1
        while True:
            room = limit - sum(1 for h in self.held.values() if h.model == model)
            if room <= 0:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), timeout=1.0)
                continue
            try:
                resp = await self.redis.xreadgroup(GROUP, self.name, streams,
                                                   count=room if self._use_count else None,
                                                   block=self.settings.intake_block_ms)
                backoff = 0.1
            except UNAVAILABLE as exc:
                log.warning("intake: redis unavailable", model=model, error=repr(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            except ResponseError as exc:
                if "NOGROUP" in str(exc):  # the stream was deleted under us (e.g. FLUSHDB): recreate
                    await self._ensure_groups()
                    continue
                raise
            if resp:
                await self._accept(model, lp, resp)

    async def _accept(self, model: str, lp: ModelLoop, resp: Any) -> None:
        now = time.time()
        fresh: list[InferenceRequest] = []
        late: list[Emitted] = []
        for stream_raw, entries in _stream_items(resp):
            stream = stream_raw.decode() if isinstance(stream_raw, bytes) else stream_raw
            for entry_id, fields in entries:
                req = await self._decode_entry(model, stream, entry_id, fields)
                if req is None:
                    continue
                self.held[req.id] = Held(model, stream, entry_id, req)
                if req.deadline_ms <= now * 1000 and lp.scheduler.deadline_aware:
                    metrics.EXPIRED_BEFORE_COMPUTE.labels(model, req.lane).inc()
                    late.append(expired_outcome(req, self.name, now, "before the worker read it"))
                else:
                    fresh.append(req)
        if late:
            await self._out.put(late)
        if fresh:
            lp.submit(Add(fresh, now))

    async def _decode_entry(self, model: str, stream: str, entry_id: bytes,
                            fields: dict[bytes, bytes]) -> InferenceRequest | None:
        try:
            return decode(fields[b"m"], InferenceRequest)
        except (CodecError, KeyError) as exc:
            log.error("undecodable stream entry: dead-lettered", stream=stream, entry=entry_id, error=str(exc))
            metrics.DEAD_LETTERS.labels(model).inc()
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(self.keys.dead_letter(model), {**fields, b"reason": str(exc).encode(),
                                                     b"stream": stream.encode()})
            pipe.xack(stream, GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()
            return None

    # --- cancellations -------------------------------------------------------------------------
    async def _cancel_listener(self) -> None:
        channels = [self.keys.cancel_channel(m) for m in self.loops]
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*channels)
                while True:
                    msg = await pubsub.get_message(timeout=5.0)
                    if msg and msg.get("type") == "message":
                        self._cancel(msg["data"].decode())
            except UNAVAILABLE as exc:
                log.warning("cancel listener: redis unavailable", error=repr(exc))
                await asyncio.sleep(1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    def _cancel(self, request_id: str) -> None:
        held = self.held.get(request_id)
        if held is not None:
            self.loops[held.model].submit(Cancel({request_id}))

    # --- publishing ----------------------------------------------------------------------------
    async def _publisher(self) -> None:
        while True:
            items = await self._out.get()
            while not self._out.empty():
                items.extend(self._out.get_nowait())
            await self._publish(items)

    async def _flush(self) -> None:
        items: list[Emitted] = []
        while not self._out.empty():
            items.extend(self._out.get_nowait())
        if items:
            await self._publish(items)

    async def _publish(self, items: list[Emitted]) -> None:
        backoff = 0.05
        while True:
            try:
                await self._write(items)
                break
            except UNAVAILABLE as exc:
                log.warning("publisher: redis unavailable, retrying", error=repr(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        for item in items:
            reqs = item.requests if isinstance(item, HandBack) else [item.request]
            for req in reqs:
                self.held.pop(req.id, None)
        self._room.set()

    async def _write(self, items: list[Emitted]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        acks: dict[str, list[bytes]] = {}
        for item in items:
            if isinstance(item, HandBack):
                self._hand_back_in(pipe, item)
                continue
            held = self.held.get(item.request.id)
            if isinstance(item, Outcome):
                self._observe(item)
                await self.store.finish_in(pipe, item.result, item.request.meta())
            if held is not None:
                acks.setdefault(held.stream, []).append(held.entry_id)
        for stream, ids in acks.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
        await pipe.execute()

    def _hand_back_in(self, pipe: aioredis.client.Pipeline, item: HandBack) -> None:
        """Re-queue unfinished work as fresh entries, then drop ours: another worker takes it at once."""
        for req in item.requests:
            held = self.held.get(req.id)
            if held is None:
                continue
            pipe.xadd(held.stream, {"m": encode(req)})
            pipe.xack(held.stream, GROUP, held.entry_id)
            pipe.xdel(held.stream, held.entry_id)
        if item.requests:
            log.info("handed back", count=len(item.requests))

    def _observe(self, o: Outcome) -> None:
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


def _stream_items(resp: Any) -> list[tuple[Any, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP replies are a list of [stream, entries] (RESP2) or a dict (RESP3)."""
    if isinstance(resp, dict):
        return [(k, v[0] if v and isinstance(v[0], list) and len(v) == 1 else v) for k, v in resp.items()]
    return [(stream, entries) for stream, entries in resp]
