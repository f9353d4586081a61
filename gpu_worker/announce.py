"""What a worker announces and hears besides its queue: a heartbeat (`batchgate up` and ops tools read
it), per-lane load figures for the gateway's admission control, and cancellations (pub/sub: fire and
forget; the record's terminal state is what the start gate checks). A port, a Redis adapter, an
in-memory one for tests, and the loops that drive them. Outages are tolerated: announcements are
retried on the next tick, the cancel listener resubscribes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from gpu_worker.redis_replies import queue_errors
from shared.codec import decode_readable, encode
from shared.keys import Keys
from shared.messages import LaneStats
from shared.redis_io import UNAVAILABLE, pubsub_of, raise_if_cancelling, tolerate_outage

log = structlog.get_logger(__name__)

HEARTBEAT_S = 2.0
ALIVE_S = 5 * HEARTBEAT_S  # a worker's liveness mark outlives its last heartbeat by this much
SILENT_WORKER_S = 60.0  # a heartbeat older than this is removed
STATS_INTERVAL_S = 0.5
STATS_TTL_MS = 30_000
RESUBSCRIBE_S = 1.0

Stats = dict[str, dict[str, LaneStats]]  # model: {stats field: figures}


class Announcer(Protocol):
    async def heartbeat(self, worker: str, info: dict[str, Any]) -> None: ...

    async def publish_stats(self, stats: Stats) -> None: ...

    async def peer_stats(self, model: str) -> list[LaneStats]:
        """Every worker's published figures for `model` (none while Redis cannot be reached)."""
        ...

    def cancels(self, models: Sequence[str]) -> AsyncIterator[str]:
        """Ids of requests cancelled from now on, for ever (reconnecting as needed)."""
        ...

    async def withdraw(self, worker: str, fields: dict[str, list[str]]) -> None:
        """Remove this worker's heartbeat and its stats fields (by model)."""

    async def last_heartbeat(self, worker: str) -> dict[str, Any] | None:
        """The last heartbeat announced under this name (None: none)."""

    async def departed(self, workers: Sequence[str]) -> set[str]:
        """Those of `workers` whose liveness mark expired. A worker whose last heartbeat carried no mark (an older
        version's, in a rolling upgrade) is never counted departed. Raises `QueueUnavailable` when Redis (or the
        part of a cluster that holds a mark) cannot be reached: the caller must know, since marks expire then."""


class RedisAnnouncer:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def heartbeat(self, worker: str, info: dict[str, Any]) -> None:
        """Announce `info` (with its time) and remove workers silent for a minute."""
        now = info["at"]
        async with tolerate_outage():
            await self.redis.set(self.keys.alive(worker), str(info.get("instance", "")), px=int(ALIVE_S * 1000))
            await self.redis.hset(self.keys.workers(), worker, json.dumps({**info, "alive_s": ALIVE_S}).encode())
            for name, raw in (await self.redis.hgetall(self.keys.workers())).items():
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    if now - json.loads(raw)["at"] > SILENT_WORKER_S:
                        await self.redis.hdel(self.keys.workers(), name)

    async def last_heartbeat(self, worker: str) -> dict[str, Any] | None:
        raw = await self.redis.hget(self.keys.workers(), worker)
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    async def departed(self, workers: Sequence[str]) -> set[str]:
        if not workers:
            return set()
        pipe = self.redis.pipeline(transaction=False)
        for worker in workers:
            pipe.exists(self.keys.alive(worker))
        pipe.hmget(self.keys.workers(), list(workers))
        async with queue_errors():
            *marks, beats = await pipe.execute()
        return {w for w, mark, beat in zip(workers, marks, beats, strict=True) if not mark and marked(beat)}

    async def publish_stats(self, stats: Stats) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for model, fields in stats.items():
            if fields:
                key = self.keys.lane_stats(model)
                pipe.hset(key, mapping={field: encode(s) for field, s in fields.items()})
                pipe.pexpire(key, STATS_TTL_MS)
        async with tolerate_outage():
            await pipe.execute()

    async def peer_stats(self, model: str) -> list[LaneStats]:
        raw: dict[bytes, bytes] = {}
        async with tolerate_outage():
            raw = await self.redis.hgetall(self.keys.lane_stats(model))
        return decode_readable(raw.values(), LaneStats)  # a worker of another schema version's are left out

    async def cancels(self, models: Sequence[str]) -> AsyncIterator[str]:
        channels = [self.keys.cancel_channel(m) for m in models]
        while True:
            pubsub = await pubsub_of(self.redis, ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(*channels)
                while True:
                    raise_if_cancelling()  # one lost in the SUBSCRIBE's send still ends the listener
                    msg = await pubsub.get_message(timeout=5.0)
                    if msg and msg.get("type") == "message":
                        yield msg["data"].decode()
            except UNAVAILABLE as exc:
                raise_if_cancelling(exc)
                log.warning("cancel listener: redis unavailable", error=repr(exc))
                await asyncio.sleep(RESUBSCRIBE_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def withdraw(self, worker: str, fields: dict[str, list[str]]) -> None:
        with contextlib.suppress(ResponseError):
            async with tolerate_outage():
                await self.redis.delete(self.keys.alive(worker))
                await self.redis.hdel(self.keys.workers(), worker)
                for model, names in fields.items():
                    if names:
                        await self.redis.hdel(self.keys.lane_stats(model), *names)


class MemoryAnnouncer:
    """For tests: keeps what was announced; `cancel(id)` plays a cancellation published by a gateway."""

    def __init__(self) -> None:
        self.workers: dict[str, dict[str, Any]] = {}
        self.stats: Stats = {}
        self._cancels: asyncio.Queue[str] = asyncio.Queue()

    def cancel(self, request_id: str) -> None:
        self._cancels.put_nowait(request_id)

    async def heartbeat(self, worker: str, info: dict[str, Any]) -> None:
        self.workers[worker] = info

    async def last_heartbeat(self, worker: str) -> dict[str, Any] | None:
        return self.workers.get(worker)

    async def departed(self, workers: Sequence[str]) -> set[str]:
        """A name this announcer never heard, or that withdrew (tests: or whose entry they removed)."""
        return {w for w in workers if w not in self.workers}

    async def publish_stats(self, stats: Stats) -> None:
        for model, fields in stats.items():
            self.stats.setdefault(model, {}).update(fields)

    async def peer_stats(self, model: str) -> list[LaneStats]:
        return list(self.stats.get(model, {}).values())

    async def cancels(self, models: Sequence[str]) -> AsyncIterator[str]:
        while True:
            yield await self._cancels.get()

    async def withdraw(self, worker: str, fields: dict[str, list[str]]) -> None:
        self.workers.pop(worker, None)
        for model, names in fields.items():
            for name in names:
                self.stats.get(model, {}).pop(name, None)


def marked(heartbeat: bytes | None) -> bool:
    """Whether a stored heartbeat is absent or came with a liveness mark (see `Announcer.departed`)."""
    if heartbeat is None:
        return True
    try:
        return "alive_s" in json.loads(heartbeat)
    except (ValueError, TypeError):
        return True


NAME_TAKEN_S = 3 * HEARTBEAT_S  # a heartbeat this recent under a worker's name: another live worker has that name


async def wait_for_unique_name(announcer: Announcer, worker: str, instance: str, stop: asyncio.Event) -> bool:
    """Before a worker announces itself: wait while another live worker (a heartbeat of another instance within
    `NAME_TAKEN_S`) has its name, saying so, since two workers under one name overwrite each other's load reports
    and admission then misjudges the capacity; a worker that died under the name stops beating, and its successor
    (a supervisor's restart) starts seconds later. False if `stop` is set meanwhile."""
    while True:
        last = await announcer.last_heartbeat(worker)
        age = time.time() - float(last.get("at", 0)) if last else None
        if last is None or last.get("instance") == instance or age is None or age > NAME_TAKEN_S:
            return True
        log.warning("another live worker has this name (BATCHGATE_WORKER_NAME must be unique); waiting until it "
                    "stops", worker=worker, its_heartbeat_s_ago=round(age, 1))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), HEARTBEAT_S)
        if stop.is_set():
            return False


async def beat(announcer: Announcer, worker: str, info: Callable[[], dict[str, Any]]) -> None:
    """One heartbeat: `info` and its time (the worker beats once before its first read, then on a loop)."""
    await announcer.heartbeat(worker, {**info(), "at": time.time()})


async def heartbeat_loop(announcer: Announcer, worker: str, info: Callable[[], dict[str, Any]]) -> None:
    while True:
        await beat(announcer, worker, info)
        raise_if_cancelling()  # a cancellation swallowed inside the Redis call still stops the loop
        await asyncio.sleep(HEARTBEAT_S)


async def stats_loop(announcer: Announcer, stats: Callable[[], Stats]) -> None:
    """Per-lane load and service figures, at a steady interval."""
    while True:
        await announcer.publish_stats(stats())
        raise_if_cancelling()
        await asyncio.sleep(STATS_INTERVAL_S)


async def cancel_loop(announcer: Announcer, models: Sequence[str], cancel: Callable[[str], None]) -> None:
    async for request_id in announcer.cancels(models):
        cancel(request_id)
