"""Calls made while earlier ones are being served, run as one batch call (group commit): concurrent submits of a
gateway share one Redis pipeline (one write, one read, one connection checkout) instead of one each.

A call starts on the next turn of the event loop with every other call made in the same turn, unless
`max_in_flight` batches are running already: then it waits for one of them to finish and goes with every call
that came meanwhile. An idle process adds no wait beyond one turn; a busy one sends fewer, larger batches."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Coalescer(Generic[T, R]):
    def __init__(self, run_many: Callable[[list[T]], Awaitable[list[R]]], *, max_in_flight: int = 2) -> None:
        self._run_many = run_many
        self.max_in_flight = max_in_flight
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._scheduled = False
        self._running: set[asyncio.Task[None]] = set()
        self.batches = 0  # batch calls made, and the items they carried
        self.items = 0

    async def __call__(self, item: T) -> R:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, fut))
        self._schedule(loop)
        return await fut

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._pending and not self._scheduled and len(self._running) < self.max_in_flight:
            self._scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        # a caller cancelled before its batch starts (its future cancelled with it) is withdrawn, never run
        batch = [(item, fut) for item, fut in self._pending if not fut.cancelled()]
        self._pending = []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._schedule(task.get_loop())

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
