"""How the Redis queue adapter reads Redis's replies and errors: RESP2 and RESP3 shapes, bytes or str,
a stream or group that is gone, and every Redis error turned into the port's `QueueUnavailable`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError, ResponseError

from gpu_worker.work_queue import QueueUnavailable
from shared.redis_io import UNAVAILABLE, raise_if_cancelling


@contextlib.asynccontextmanager
async def queue_errors() -> AsyncIterator[None]:
    """Redis errors leave as `QueueUnavailable`; a cancellation stays a cancellation (redis-py can turn
    the cancellation of a command in flight into a ConnectionError)."""
    try:
        yield
    except (*UNAVAILABLE, RedisError) as exc:
        raise_if_cancelling(exc)
        raise QueueUnavailable(repr(exc)) from exc


def stream_items(resp: Any) -> list[tuple[str, list[tuple[bytes, dict[bytes, bytes]]]]]:
    """XREADGROUP replies: a list of [stream, entries] (RESP2) or a dict (RESP3); deleted entries left out."""
    items = resp.items() if isinstance(resp, dict) else resp
    return [(as_str(stream), [(as_bytes(eid), fields) for eid, fields in entries if fields])
            for stream, entries in items]


def no_group(exc: ResponseError) -> bool:
    """The stream or its group is gone (fakeredis words it differently for XREADGROUP)."""
    return "NOGROUP" in str(exc) or "requires the key to exist" in str(exc)


def as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def as_str(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
