"""The publisher on the in-memory queue: record before ack, retries after an outage, nothing written twice."""

from __future__ import annotations

import time
from collections.abc import Sequence

from gpu_worker import publisher as publisher_module
from gpu_worker.memory_queue import MemoryQueue
from gpu_worker.outcomes import Ack, HandBack, Outcome, result_for
from gpu_worker.publisher import Publisher
from gpu_worker.work_queue import Finished, Held, QueueUnavailable
from shared.states import FinishReason, Status
from tests.fakes import make_request

STREAM = "unit:{m:m}:lane:short"


class FlakyQueue(MemoryQueue):
    """Fails the first hand-back, after the records and acks before it landed; counts every call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def complete(self, finished: Sequence[Finished]) -> None:
        self.calls.append("complete")
        await super().complete(finished)

    async def hand_back(self, held: Sequence[Held]) -> None:
        self.calls.append("hand_back")
        if self.calls.count("hand_back") == 1:
            raise QueueUnavailable("connection lost")
        await super().hand_back(held)


async def test_a_retry_repeats_only_the_step_that_failed(monkeypatch):
    monkeypatch.setattr(publisher_module, "BACKOFF_START_S", 0.001)
    q = FlakyQueue()
    await q.create_groups([STREAM])
    reqs = [make_request(f"r{i}") for i in range(3)]
    for r in reqs:
        await q.enqueue(STREAM, r)
    held = {r.id: Held("m", STREAM, e.id, r)
            for e, r in zip(await q.read("w", [STREAM], 10, 0), reqs, strict=True)}
    read_ids = {h.entry_id for h in held.values()}
    released: list[int] = []
    pub = Publisher(q, held, lambda: released.append(len(held)))
    done = Outcome(reqs[0], result_for(reqs[0], Status.SUCCEEDED, worker="w", now=time.time(),
                                       reason=FinishReason.LENGTH))
    await pub.publish([done, Ack(reqs[1]), HandBack([reqs[2]])])
    assert q.calls == ["complete", "hand_back", "hand_back"]  # the record is not written twice
    assert q.records["r0"].state is Status.SUCCEEDED
    fresh = q.entries(STREAM)
    assert len(fresh) == 1 and not set(fresh) & read_ids  # one fresh copy; ours are gone
    assert held == {} and released == [0]
    assert await q.pending(STREAM, "w", 10) == {}
