"""`shared.coalesce.Coalescer`: the calls of one turn of the event loop run as one batch call; each caller gets its
own result, every caller of a failed batch its failure; a caller that leaves before its batch starts is withdrawn."""

from __future__ import annotations

import asyncio

import pytest

from shared.coalesce import Coalescer


async def turns(n: int = 3) -> None:
    """Let the loop run `n` turns: a call's batch is flushed on the next turn and starts on the one after."""
    for _ in range(n):
        await asyncio.sleep(0)


class Recorder:
    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.fail_on = fail_on
        self.gate = asyncio.Event()
        self.gate.set()

    async def run(self, items: list[int]) -> list[int]:
        self.batches.append(items)
        await self.gate.wait()
        if self.fail_on in items:
            raise ConnectionError(f"batch with {self.fail_on}")
        return [i * 10 for i in items]


async def test_calls_of_one_turn_run_as_one_batch_each_with_its_own_result():
    rec = Recorder()
    c = Coalescer(rec.run)
    assert await asyncio.gather(*(c(i) for i in range(5))) == [0, 10, 20, 30, 40]
    assert rec.batches == [[0, 1, 2, 3, 4]]
    assert (c.batches, c.items) == (1, 5)


async def test_calls_of_later_turns_go_in_the_next_batch_while_one_runs():
    rec = Recorder()
    rec.gate.clear()
    c = Coalescer(rec.run)
    first = [asyncio.ensure_future(c(i)) for i in (1, 2)]
    await turns()
    later = [asyncio.ensure_future(c(i)) for i in (3, 4)]
    await turns()
    assert rec.batches == [[1, 2], [3, 4]]  # the second did not wait for the first to finish
    rec.gate.set()
    assert await asyncio.gather(*first, *later) == [10, 20, 30, 40]


async def test_a_failed_batch_fails_each_of_its_callers_and_no_other():
    rec = Recorder(fail_on=2)
    c = Coalescer(rec.run)
    bad = await asyncio.gather(*(c(i) for i in (1, 2, 3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in bad)
    assert await c(4) == 40


async def test_a_caller_that_leaves_before_its_batch_starts_is_withdrawn():
    rec = Recorder()
    c = Coalescer(rec.run)
    leaving = asyncio.ensure_future(c(1))
    staying = asyncio.ensure_future(c(2))
    await asyncio.sleep(0)  # both asked; the batch starts on the next turn
    leaving.cancel()
    assert await staying == 20
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert rec.batches == [[2]]


async def test_a_caller_that_leaves_after_its_batch_started_leaves_the_batch_running():
    rec = Recorder()
    rec.gate.clear()
    c = Coalescer(rec.run)
    leaving = asyncio.ensure_future(c(1))
    staying = asyncio.ensure_future(c(2))
    await turns()
    leaving.cancel()
    rec.gate.set()
    assert await staying == 20
    assert rec.batches == [[1, 2]]


async def test_calls_made_while_max_in_flight_batches_run_wait_and_go_together():
    rec = Recorder()
    rec.gate.clear()
    c = Coalescer(rec.run, max_in_flight=2)
    calls = [asyncio.ensure_future(c(i)) for i in (1, 2)]
    await turns()
    calls += [asyncio.ensure_future(c(i)) for i in (3,)]
    await turns()
    for wave in ((4, 5), (6,)):  # two batches run: these wait, in separate turns
        calls += [asyncio.ensure_future(c(i)) for i in wave]
        await turns()
    assert rec.batches == [[1, 2], [3]]
    rec.gate.set()
    assert await asyncio.gather(*calls) == [10, 20, 30, 40, 50, 60]
    assert rec.batches == [[1, 2], [3], [4, 5, 6]]  # what came meanwhile went as one batch
