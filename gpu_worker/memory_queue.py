"""The queue port (`gpu_worker.work_queue`) in memory, for tests: pure Python on asyncio, clock injected.

Streams and their consumer groups are modelled in `gpu_worker.memory_streams`; here are the result
records' rules (the first terminal write wins; `mark_running` refuses terminal requests and counts
attempts), a vanished group recreated by `read`, and blocking: `read` waits in real time on an asyncio
event that `add` sets. `available = False` makes every call raise `QueueUnavailable`.
Not modelled: the tenants' backlog sets, done events, webhook deliveries, trimming.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpu_worker.memory_streams import Group, Stream
from gpu_worker.work_queue import DeadLetter, Entry, Finished, Held, QueueUnavailable, entry_fields
from shared.messages import InferenceRequest, RequestResult, StreamDelta
from shared.states import TERMINAL, Status


@dataclass(slots=True)
class Record:
    state: Status
    result: RequestResult | None = None
    attempts: int = 0
    started_ms: int | None = None


class MemoryQueue:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.streams: dict[str, Stream] = {}
        self.records: dict[str, Record] = {}
        self.deltas: dict[str, list[StreamDelta]] = {}  # per streaming request, as published
        self.available = True
        self._last_id = (0, 0)
        self._arrived = asyncio.Event()

    # --- helpers for tests -----------------------------------------------------------------------
    def add(self, stream: str, fields: dict[bytes, bytes]) -> bytes:
        """Append raw fields (an entry no validation of ours produced, say)."""
        ms = int(self.clock() * 1000)
        self._last_id = (ms, 0) if ms > self._last_id[0] else (self._last_id[0], self._last_id[1] + 1)
        eid = f"{self._last_id[0]}-{self._last_id[1]}".encode()
        self._stream(stream).entries[eid] = fields
        self._arrived.set()
        return eid

    def finish(self, result: RequestResult) -> bool:
        """A terminal write (the gateway's cancel, a worker's result); True when it won."""
        rec = self.records.get(result.id)
        if rec is not None and rec.state in TERMINAL:
            return False
        if rec is None:
            rec = self.records[result.id] = Record(result.status)
        rec.state, rec.result = result.status, result
        return True

    def flush(self) -> None:
        """Everything gone, as after a restart of an empty Redis."""
        self.streams.clear()
        self.records.clear()

    def entries(self, stream: str) -> dict[bytes, dict[bytes, bytes]]:
        return dict(self.streams[stream].entries) if stream in self.streams else {}

    def _check(self) -> None:
        if not self.available:
            raise QueueUnavailable("the in-memory queue is switched off")

    def _group(self, stream: str) -> Group | None:
        s = self.streams.get(stream)
        return s.group if s is not None else None

    def _stream(self, name: str) -> Stream:
        return self.streams.setdefault(name, Stream(name))

    def _delete(self, stream: str, entry_id: bytes) -> None:
        if stream in self.streams:
            self.streams[stream].delete(entry_id)

    # --- the port --------------------------------------------------------------------------------
    async def create_groups(self, streams: Sequence[str]) -> None:
        self._check()
        for name in streams:
            s = self._stream(name)
            if s.group is None:
                s.group = Group()

    async def enqueue(self, stream: str, request: InferenceRequest) -> bytes:
        self._check()
        return self.add(stream, entry_fields(request))

    async def read(self, consumer: str, streams: Sequence[str], count: int, block_s: float) -> list[Entry]:
        self._check()
        if any(self._group(s) is None for s in streams):
            await self.create_groups(streams)  # NOGROUP: recreated, and this read returns nothing
            return []
        end = asyncio.get_running_loop().time() + block_s
        while True:
            got = self._deliver(consumer, streams, count)
            left = end - asyncio.get_running_loop().time()
            if got or left <= 0:
                return got
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left)
            self._check()

    def _deliver(self, consumer: str, streams: Sequence[str], count: int) -> list[Entry]:
        out: list[Entry] = []
        for name in streams:
            if name in self.streams:
                out.extend(self.streams[name].deliver(consumer, count - len(out), self.clock()))
        return out

    async def pending(self, stream: str, consumer: str, count: int) -> dict[bytes, int]:
        self._check()
        g = self._group(stream)
        owned = list(g.owned_by(consumer).items())[:count] if g else []
        return {eid: p.deliveries for eid, p in owned}

    async def renew(self, consumer: str, held: dict[str, list[bytes]]) -> int:
        self._check()
        return sum(g.renew(consumer, ids, self.clock()) for stream, ids in held.items()
                   if ids and (g := self._group(stream)) is not None)

    async def reclaim(self, consumer: str, stream: str, min_idle_s: float, count: int,
                      owner: str | None = None) -> list[Entry]:
        self._check()
        s = self.streams.get(stream)
        return s.claim_idle(consumer, min_idle_s, count, self.clock(), owner) if s is not None else []

    async def dead_letter(self, dead_stream: str, letters: Sequence[DeadLetter]) -> None:
        self._check()
        for letter in letters:
            if letter.failed is not None:
                self.finish(letter.failed.result)
        for letter in letters:
            e = letter.entry
            self.add(dead_stream, {**e.fields, b"reason": letter.reason.encode(), b"stream": e.stream.encode(),
                                   b"deliveries": str(e.deliveries).encode()})
            self._delete(e.stream, e.id)

    async def complete(self, finished: Sequence[Finished]) -> None:
        self._check()
        for f in finished:
            self.finish(f.result)
        for f in finished:
            if f.held is not None:
                self._delete(f.held.stream, f.held.entry_id)

    async def ack(self, held: Sequence[Held]) -> None:
        self._check()
        for h in held:
            self._delete(h.stream, h.entry_id)

    async def hand_back(self, held: Sequence[Held]) -> None:
        self._check()
        for h in held:
            rec = self.records.get(h.request.id)
            if rec is not None and rec.state is Status.RUNNING:  # queued again, as the Redis queue marks it
                rec.state, rec.started_ms = Status.QUEUED, None
            self.add(h.stream, entry_fields(h.request))
            self._delete(h.stream, h.entry_id)

    async def publish_deltas(self, deltas: Sequence[tuple[str, StreamDelta, bool]]) -> None:
        self._check()
        for request_id, delta, _ in deltas:
            self.deltas.setdefault(request_id, []).append(delta)

    async def streamed(self, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        self._check()
        return {rid: tuple(t for d in self.deltas[rid] for t in d.token_ids) for rid in request_ids
                if self.deltas.get(rid)}

    async def mark_running(self, requests: Sequence[InferenceRequest], now_ms: int) -> list[bool]:
        self._check()
        out = []
        for req in requests:
            rec = self.records.setdefault(req.id, Record(Status.QUEUED))
            if rec.state in TERMINAL:
                out.append(False)
                continue
            rec.state, rec.started_ms, rec.attempts = Status.RUNNING, now_ms, rec.attempts + 1
            out.append(True)
        return out

    async def consumers(self, stream: str) -> dict[str, int]:
        self._check()
        g = self._group(stream)
        return {name: len(g.owned_by(name)) for name in g.consumers} if g else {}

    async def clean_departed(self, streams: Sequence[str], keep: str, idle_s: float) -> int:
        self._check()
        now, removed = self.clock(), 0
        for stream in streams:
            g = self._group(stream)
            if g is None:
                continue
            for name, seen in list(g.consumers.items()):
                if name != keep and not g.owned_by(name) and now - seen >= idle_s:
                    del g.consumers[name]
                    removed += 1
        return removed

    async def leave(self, consumer: str, streams: Sequence[str]) -> None:
        self._check()
        for stream in streams:
            g = self._group(stream)
            if g is not None and not g.owned_by(consumer):
                g.consumers.pop(consumer, None)

