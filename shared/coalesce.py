"""Calls made in one turn of the event loop, run as one batch call: concurrent submits of a gateway share one Redis
pipeline (one write, one read, one connection checkout) instead of one each. A caller waits only for its own
batch, which starts on the next turn: no timer, no added wait beyond that turn."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(self, run_many: Callable[[list[T]], Awaitable[list[R]]]) -> None:
        self._run_many = run_many
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0  # batch calls made, and the items they carried (for the benchmark's figures)
        self.items = 0

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((item, fut))
        return await fut

    def _flush(self) -> None:
        # a caller cancelled before its batch starts (its future cancelled with it) is withdrawn, never run
        batch = [(item, fut) for item, fut in self._pending if not fut.cancelled()]
        self._pending = []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        self.batches += 1
        self.items += len(batch)
        try:
            results = await self._run_many([item for item, _ in batch])
        except BaseException as exc:  # every caller of the batch sees its failure
            for _, fut in batch:
                if not fut.done():
                    fut.cancel() if isinstance(exc, asyncio.CancelledError) else fut.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)
