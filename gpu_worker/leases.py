"""Ownership of stream entries across workers: renew, reclaim, dead-letter, clean up consumers.

Streams + consumer groups deliver at least once. An entry a worker read stays in the group's
pending list (PEL) until XACK. This module keeps that safe:
- a live worker renews its hold on every entry it still works on or buffers (`XCLAIM ... JUSTID`
  with min-idle 0 resets the idle time without counting a delivery), so a long generation or a
  batch window never lets another worker take it;
- a worker reclaims entries idle for longer than the threshold (their worker died or hung) with
  XAUTOCLAIM; an entry delivered more than `max_deliveries` times keeps killing workers and goes to
  the dead-letter stream instead, ending `failed`;
- consumers of departed workers are deleted once their pending list is empty.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.keys import GROUP

DEAD_LETTER_MAXLEN = 10_000


@dataclass(frozen=True, slots=True)
class Claimed:
    stream: str
    entry_id: bytes
    fields: dict[bytes, bytes]
    deliveries: int


async def renew(redis: aioredis.Redis, consumer: str, held: dict[str, list[bytes]]) -> int:
    """Reset the idle time of entries this consumer still owns. Returns how many were renewed.

    Only entries still in *our* pending list are renewed: one that another worker reclaimed while
    we were paused stays theirs (the first terminal write wins either way)."""
    renewed = 0
    for stream, ids in held.items():
        if not ids:
            continue
        mine = await pending_of(redis, stream, consumer, len(ids) + 100)
        keep = [i for i in ids if i in mine]
        if keep:
            await redis.xclaim(stream, GROUP, consumer, 0, keep, justid=True)
            renewed += len(keep)
    return renewed


async def pending_of(redis: aioredis.Redis, stream: str, consumer: str, count: int) -> dict[bytes, int]:
    """{entry id: deliveries} of a consumer's pending entries."""
    rows = await redis.xpending_range(stream, GROUP, min="-", max="+", count=count, consumername=consumer)
    return {_b(r["message_id"]): int(r["times_delivered"]) for r in rows}


async def reclaim(redis: aioredis.Redis, stream: str, consumer: str, min_idle_ms: int,
                  count: int) -> list[Claimed]:
    """Take over entries idle for `min_idle_ms` (their worker is gone), with their delivery counts."""
    try:
        resp = await redis.xautoclaim(stream, GROUP, consumer, min_idle_ms, start_id="0-0", count=count)
    except ResponseError as exc:
        if "NOGROUP" in str(exc):
            return []
        raise
    entries = resp[1] if len(resp) > 1 else []
    entries = [(eid, fields) for eid, fields in entries if fields]  # deleted entries come back empty
    if not entries:
        return []
    counts = await pending_of(redis, stream, consumer, count + 1000)
    return [Claimed(stream, _b(eid), fields, counts.get(_b(eid), 1)) for eid, fields in entries]


def dead_letter_in(pipe: aioredis.client.Pipeline, dead_stream: str, c: Claimed, reason: str) -> None:
    pipe.xadd(dead_stream, {**c.fields, b"reason": reason.encode(), b"stream": c.stream.encode(),
                            b"deliveries": str(c.deliveries).encode()},
              maxlen=DEAD_LETTER_MAXLEN, approximate=True)
    pipe.xack(c.stream, GROUP, c.entry_id)
    pipe.xdel(c.stream, c.entry_id)


async def clean_consumers(redis: aioredis.Redis, streams: Iterable[str], keep: str, idle_ms: int) -> int:
    """Delete consumers other than `keep` that own nothing and have been idle for `idle_ms`."""
    removed = 0
    for stream in streams:
        try:
            consumers = await redis.xinfo_consumers(stream, GROUP)
        except ResponseError:
            continue
        for c in consumers:
            name = _s(c["name"])
            if name != keep and int(c["pending"]) == 0 and int(c["idle"]) >= idle_ms:
                await redis.xgroup_delconsumer(stream, GROUP, name)
                removed += 1
    return removed


async def leave(redis: aioredis.Redis, streams: Iterable[str], consumer: str) -> None:
    """On a clean shutdown: delete our consumer from each group if we own nothing there any more."""
    for stream in streams:
        if not await pending_of(redis, stream, consumer, 1):
            await redis.xgroup_delconsumer(stream, GROUP, consumer)


def _b(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
