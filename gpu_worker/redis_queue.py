"""The queue port (`gpu_worker.work_queue`) over Redis Streams with a consumer group per lane stream.

- read: XREADGROUP `>`; a NOGROUP reply (Redis restarted empty, FLUSHDB) recreates the groups. fakeredis
  answers XREADGROUP COUNT+BLOCK at once on an empty stream (RELIABILITY.md), and XREADGROUP BLOCK without
  COUNT moves entries already there to the pending list but returns none of them (seen with 2.40):
  `create_groups` probes for the first; on such a server a read takes what is there without blocking,
  and if nothing is, waits on XREAD BLOCK `$` (which takes nothing) before taking what arrived.
- renew: `XCLAIM <stream> <group> <self> 0 <ids> JUSTID` resets the idle time without counting a
  delivery, for the entries still in our own pending list only.
- reclaim: XAUTOCLAIM (one owner's: XPENDING IDLE, then XCLAIM), then XPENDING for the delivery counts;
  entries deleted meanwhile are dropped.
- terminal records: the Lua scripts of `shared.records` (first terminal write wins, atomically with
  the done event and the webhook delivery); acks go in a second pipeline, after the records landed.
- trimming: an acked entry is deleted at once (XDEL); the dead-letter stream is capped (approximate).
Every Redis error leaves as `QueueUnavailable` (`gpu_worker.redis_replies`).
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from gpu_worker.delta_script import DELTA_LUA, EVENTS_SLACK_S
from gpu_worker.hand_back_script import HAND_BACK_LUA, hand_back_calls
from gpu_worker.redis_replies import as_bytes, as_str, no_group, queue_errors, stream_items
from gpu_worker.work_queue import DeadLetter, Entry, Finished, Held, entry_fields
from shared.codec import encode
from shared.events import streamed_tokens
from shared.faults import Faults
from shared.keys import GROUP, Keys
from shared.messages import InferenceRequest, StreamDelta
from shared.records import RecordStore, completed_delivery
from shared.redis_io import in_pipeline
from shared.states import Status
from shared.waiters import DELTA

log = structlog.get_logger(__name__)

DEAD_LETTER_MAXLEN = 10_000
PENDING_SLACK = 100  # renew: how many more of our pending entries to list than we hold


class RedisQueue:
    def __init__(self, redis: aioredis.Redis, keys: Keys, store: RecordStore, faults: Faults | None = None,
                 expiry_grace_s: float = 2.0) -> None:
        self.redis = redis
        self.margin_ms = int((expiry_grace_s + EVENTS_SLACK_S) * 1000)  # what the events outlive the record by
        self.keys = keys
        self.store = store
        self.faults = faults or Faults()
        self.blocks_with_count = True  # False on a server that answers XREADGROUP COUNT+BLOCK at once

    async def create_groups(self, streams: Sequence[str]) -> None:
        async with queue_errors():
            await self._create_groups(streams)
            await self._probe_blocking_count()

    async def _create_groups(self, streams: Sequence[str]) -> None:
        for stream in streams:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _probe_blocking_count(self) -> None:
        probe = f"{self.keys.prefix}:probe:{secrets.token_hex(4)}"
        try:
            await self.redis.xgroup_create(probe, GROUP, id="$", mkstream=True)
            t0 = time.monotonic()
            await self.redis.xreadgroup(GROUP, "probe", {probe: ">"}, count=1, block=200)
            self.blocks_with_count = time.monotonic() - t0 >= 0.1
        finally:
            await self.redis.delete(probe)
        if not self.blocks_with_count:
            log.warning("this Redis does not block on XREADGROUP with COUNT (fakeredis?): waiting on XREAD instead")

    async def enqueue(self, stream: str, request: InferenceRequest) -> bytes:
        async with queue_errors():
            return as_bytes(await self.redis.xadd(stream, entry_fields(request)))

    async def read(self, consumer: str, streams: Sequence[str], count: int, block_s: float) -> list[Entry]:
        block = int(block_s * 1000) or None
        async with queue_errors():
            try:
                if self.blocks_with_count:
                    return await self._read_group(consumer, streams, count, block)
                got = await self._read_group(consumer, streams, count, None)
                if got or block is None:
                    return got
                await self.redis.xread({s: "$" for s in streams}, count=1, block=block)
                return await self._read_group(consumer, streams, count, None)
            except ResponseError as exc:
                if not no_group(exc):
                    raise
                await self._create_groups(streams)  # the stream is gone: recreate the groups, read again
                return []

    async def _read_group(self, consumer: str, streams: Sequence[str], count: int, block: int | None) -> list[Entry]:
        resp = await self.redis.xreadgroup(GROUP, consumer, {s: ">" for s in streams}, count=count, block=block)
        return [Entry(stream, eid, fields) for stream, entries in stream_items(resp or [])
                for eid, fields in entries]

    async def pending(self, stream: str, consumer: str, count: int) -> dict[bytes, int]:
        async with queue_errors():
            return await self._pending(stream, consumer, count)

    async def _pending(self, stream: str, consumer: str, count: int) -> dict[bytes, int]:
        try:
            rows = await self.redis.xpending_range(stream, GROUP, min="-", max="+", count=count,
                                                   consumername=consumer)
        except ResponseError as exc:
            if no_group(exc):
                return {}
            raise
        return {as_bytes(r["message_id"]): int(r["times_delivered"]) for r in rows}

    async def renew(self, consumer: str, held: dict[str, list[bytes]]) -> int:
        """Only entries still in *our* pending list are renewed: one that another worker reclaimed while we
        were paused stays theirs (the first terminal write wins either way)."""
        renewed = 0
        async with queue_errors():
            for stream, ids in held.items():
                if not ids:
                    continue
                mine = await self._pending(stream, consumer, len(ids) + PENDING_SLACK)
                keep = [i for i in ids if i in mine]
                if keep:
                    await self.redis.xclaim(stream, GROUP, consumer, 0, keep, justid=True)
                    renewed += len(keep)
        return renewed

    async def reclaim(self, consumer: str, stream: str, min_idle_s: float, count: int,
                      owner: str | None = None) -> list[Entry]:
        idle_ms = int(min_idle_s * 1000)
        async with queue_errors():
            try:
                if owner is None:
                    resp = await self.redis.xautoclaim(stream, GROUP, consumer, idle_ms, start_id="0-0", count=count)
                    entries = resp[1] if len(resp) > 1 else []
                else:  # XPENDING's IDLE filter, then XCLAIM with the same floor (an entry renewed meanwhile stays)
                    rows = await self.redis.xpending_range(stream, GROUP, "-", "+", count, consumername=owner,
                                                           idle=idle_ms)
                    ids = [as_bytes(r["message_id"]) for r in rows]
                    entries = await self.redis.xclaim(stream, GROUP, consumer, idle_ms, ids) if ids else []
            except ResponseError as exc:
                if no_group(exc):
                    return []
                raise
            entries = [(as_bytes(eid), fields) for eid, fields in entries if fields]  # deleted entries come back empty
            if not entries:
                return []
            counts = await self._pending(stream, consumer, count + 1000)
        return [Entry(stream, eid, fields, counts.get(eid, 1)) for eid, fields in entries]

    async def dead_letter(self, dead_stream: str, letters: Sequence[DeadLetter]) -> None:
        if not letters:
            return
        async with queue_errors():
            await self._finish([letter.failed for letter in letters if letter.failed is not None])
            pipe = self.redis.pipeline(transaction=False)
            for letter in letters:
                e = letter.entry
                pipe.xadd(dead_stream, {**e.fields, b"reason": letter.reason.encode(), b"stream": e.stream.encode(),
                                        b"deliveries": str(e.deliveries).encode()},
                          maxlen=DEAD_LETTER_MAXLEN, approximate=True)
                pipe.xack(e.stream, GROUP, e.id)
                pipe.xdel(e.stream, e.id)
            await pipe.execute()

    async def complete(self, finished: Sequence[Finished]) -> None:
        if not finished:
            return
        async with queue_errors():
            await self._finish(finished)
            pipe = self.redis.pipeline(transaction=False)
            self._ack_in(pipe, [f.held for f in finished if f.held is not None])
            for f in finished:  # no longer counts against its tenant's backlog quota
                if f.request.quota_slot:
                    pipe.zrem(self.keys.tenant_active(f.request.tenant), f.request.id)
            await self._execute_acks(pipe)

    async def _finish(self, finished: Sequence[Finished]) -> None:
        """Write the results (each with its "done" event and its webhook into the record's outbox), move the
        winners' webhooks to the callback stream, and sweep the outboxes of those that lost (another writer won
        and may have died before moving its webhook): all before any of their stream entries is acked."""
        if not finished:
            return
        won = await self.store.finish_all([(f.result, f.request.meta()) for f in finished])
        self.faults.point("kill_after_result_write")
        await self.store.flush([d for f, w in zip(finished, won, strict=True)
                                if w and (d := completed_delivery(f.result, f.request.meta())) is not None])
        await self.store.sweep([f.request.id for f, w in zip(finished, won, strict=True) if not w])

    async def ack(self, held: Sequence[Held]) -> None:
        if held:
            async with queue_errors():
                await self.store.sweep([h.request.id for h in held])  # a terminal record's last entry
                pipe = self.redis.pipeline(transaction=False)
                self._ack_in(pipe, held)
                await self._execute_acks(pipe)

    async def hand_back(self, held: Sequence[Held]) -> None:
        """Their records `queued` again, then fresh entries, then ours dropped: another worker takes them at once,
        without waiting for the reclaim threshold. The records first, in a round trip of their own: a fresh entry
        another worker starts at once is never marked queued after that start (on a cluster, the record and the
        stream are on different nodes, which a pipeline reaches side by side)."""
        if held:
            async with queue_errors():
                await self.store.requeue([h.request.id for h in held])
                pipe = self.redis.pipeline(transaction=False)
                for streams, args in hand_back_calls(held):
                    in_pipeline(pipe, HAND_BACK_LUA, streams, args)
                await self._execute_acks(pipe)

    def _ack_in(self, pipe: aioredis.client.Pipeline, held: Sequence[Held]) -> None:
        by_stream: dict[str, list[bytes]] = {}
        for h in held:
            by_stream.setdefault(h.stream, []).append(h.entry_id)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)

    async def _execute_acks(self, pipe: aioredis.client.Pipeline) -> None:
        if len(pipe):
            await pipe.execute()
            self.faults.point("kill_after_ack")

    async def publish_deltas(self, deltas: Sequence[tuple[str, StreamDelta, bool]]) -> None:
        if deltas:
            async with queue_errors():
                pipe = self.redis.pipeline(transaction=False)
                for request_id, delta, first in deltas:
                    data = encode(delta)
                    in_pipeline(pipe, DELTA_LUA, [self.keys.events(request_id), self.keys.record(request_id)],
                                [data, self.store.result_ttl_ms, self.margin_ms, self.keys.done_channel(request_id),
                                 DELTA + data, "1" if first else ""])
                await pipe.execute()

    async def streamed(self, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        async with queue_errors():
            return await streamed_tokens(self.redis, self.keys, request_ids)

    async def mark_running(self, requests: Sequence[InferenceRequest], now_ms: int) -> list[bool]:
        async with queue_errors():
            states = await self.store.start(list(requests), now_ms)
        return [s is Status.RUNNING for s in states]

    async def consumers(self, stream: str) -> dict[str, int]:
        async with queue_errors():
            return {name: pending for name, pending, _ in await self._consumers(stream)}

    async def clean_departed(self, streams: Sequence[str], keep: str, idle_s: float) -> int:
        removed = 0
        async with queue_errors():
            for stream in streams:
                for name, pending, idle_ms in await self._consumers(stream):
                    if name != keep and pending == 0 and idle_ms >= idle_s * 1000:
                        await self.redis.xgroup_delconsumer(stream, GROUP, name)
                        removed += 1
        return removed

    async def _consumers(self, stream: str) -> list[tuple[str, int, int]]:
        """(name, pending entries, idle ms) of each consumer of the stream's group; none if it has no group."""
        try:
            rows = await self.redis.xinfo_consumers(stream, GROUP)
        except ResponseError:
            return []
        return [(as_str(c["name"]), int(c["pending"]), int(c["idle"])) for c in rows]

    async def leave(self, consumer: str, streams: Sequence[str]) -> None:
        async with queue_errors():
            for stream in streams:
                if not await self._pending(stream, consumer, 1):
                    with contextlib.suppress(ResponseError):  # NOGROUP: nothing to leave
                        await self.redis.xgroup_delconsumer(stream, GROUP, consumer)

