"""Redis client construction: one place that sets timeouts, retries and backoff."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

# Errors that mean "Redis is not reachable right now" (as opposed to a bad command).
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)


def make_redis(url: str, *, socket_timeout: float = 10.0, retries: int = 2,
               max_connections: int | None = 200) -> aioredis.Redis:
    """An asyncio client with bounded timeouts and a short retry on connection errors.

    `socket_timeout` must exceed the longest BLOCK a caller uses (intake blocks for ~1 s).
    A thawed serverless container or a restarted Redis leaves dead connections in the pool: the
    retry reconnects once or twice with jittered backoff before the error reaches the caller.
    """
    # A blocking pool: under a burst of concurrent requests, callers wait (up to 5 s) for a free
    # connection instead of failing with "Too many connections".
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections or 200,
        timeout=5,
        socket_connect_timeout=2.0,
        socket_timeout=socket_timeout,
        socket_keepalive=True,
        health_check_interval=30,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
        decode_responses=False,
    )
    return aioredis.Redis(connection_pool=pool, auto_close_connection_pool=True)


def raise_if_cancelling(exc: BaseException | None = None) -> None:
    """redis-py can turn the cancellation of a command in flight into a ConnectionError; a loop that
    tolerates outages must not swallow its own cancellation with it (the task would never stop)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


@contextlib.asynccontextmanager
async def tolerate_outage() -> AsyncIterator[None]:
    """Like `contextlib.suppress(*UNAVAILABLE)`, minus swallowing a cancellation."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise_if_cancelling(exc)
