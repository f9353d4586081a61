"""The worker's queue port: what the worker needs from the lane streams and the result records.

Invariant (at-least-once inside, exactly-once visible), kept by every implementation and by the worker:
- an entry read by a consumer stays pending (owned by that consumer, with its idle time and delivery
  count) until it is acknowledged; nothing else removes it, except reclaim by another consumer once it
  has been idle `min_idle` (its owner died or hung) and dead-lettering;
- `renew` resets the idle time of entries the consumer still owns without counting a delivery, so a
  live worker's entries are never reclaimed; it never takes back an entry another consumer reclaimed;
- `reclaim` counts a delivery; an entry delivered more than `max_deliveries` times is dead-lettered
  (kept on the dead-letter stream with its reason) and its request ends `failed`;
- an entry is acknowledged (and deleted) only after its request's terminal record exists (`complete`,
  `dead_letter`), or when a record already is terminal (`ack`), or after a fresh copy is queued for
  another worker (`hand_back`): a crash between two steps leaves it pending, never lost;
- the first terminal write of a request wins; later ones change nothing (so redelivery is harmless);
- `mark_running` answers, per request, whether it is still live (not terminal, not cancelled): a
  request that is not is never computed.
Errors: an implementation raises `QueueUnavailable` when the backing store cannot be reached or refuses
a command; the caller retries with backoff. Stream names come from `shared.keys.Keys`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.codec import decode, encode
from shared.messages import InferenceRequest, RequestResult, StreamDelta


class QueueUnavailable(Exception):
    """The queue's backing store is unreachable or refused a command; retry later."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A stream entry as read or reclaimed: its raw fields (decoded by the worker) and delivery count."""

    stream: str
    id: bytes
    fields: dict[bytes, bytes]
    deliveries: int = 1


@dataclass(slots=True)
class Held:
    """A stream entry this worker read and has not acknowledged yet, with its decoded request."""

    model: str
    stream: str
    entry_id: bytes
    request: InferenceRequest


@dataclass(frozen=True, slots=True)
class Finished:
    """A request's terminal result, and the entry to acknowledge once it is written (None: not held)."""

    request: InferenceRequest
    result: RequestResult
    held: Held | None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An entry to move to the dead-letter stream; `failed` is its request's result, when it decodes."""

    entry: Entry
    reason: str
    failed: Finished | None = None


def entry_fields(request: InferenceRequest) -> dict[bytes, bytes]:
    """A request as a stream entry's fields (the gateway writes the same shape)."""
    return {b"m": encode(request)}


def decode_request(entry: Entry) -> InferenceRequest:
    """The request an entry carries; raises CodecError or KeyError when there is none."""
    return decode(entry.fields[b"m"], InferenceRequest)


class WorkQueue(Protocol):
    async def create_groups(self, streams: Sequence[str]) -> None:
        """Create the consumer group of each stream (and the stream) if missing."""

    async def enqueue(self, stream: str, request: InferenceRequest) -> bytes:
        """Append a request to a lane stream; returns the entry id."""

    async def read(self, consumer: str, streams: Sequence[str], count: int, block_s: float) -> list[Entry]:
        """Up to `count` entries never delivered before, now pending for `consumer`; waits up to `block_s`
        for the first one (never to fill `count`). A stream whose group vanished is recreated empty."""

    async def pending(self, stream: str, consumer: str, count: int) -> dict[bytes, int]:
        """{entry id: deliveries} of the entries `consumer` owns on `stream` (at most `count`)."""

    async def renew(self, consumer: str, held: dict[str, list[bytes]]) -> int:
        """Reset the idle time of those entries (by stream) `consumer` still owns; returns how many."""

    async def reclaim(self, consumer: str, stream: str, min_idle_s: float, count: int,
                      owner: str | None = None) -> list[Entry]:
        """Take over up to `count` entries idle for `min_idle_s` (only `owner`'s, when given), in id order, each
        with its raised delivery count."""

    async def dead_letter(self, dead_stream: str, letters: Sequence[DeadLetter]) -> None:
        """Write each failed result (first wins), copy each entry to `dead_stream`, then ack and delete it."""

    async def complete(self, finished: Sequence[Finished]) -> None:
        """Write each terminal result (first wins, with its done event), then ack and delete the held entries."""

    async def ack(self, held: Sequence[Held]) -> None:
        """Ack and delete entries whose requests are already terminal."""

    async def hand_back(self, held: Sequence[Held]) -> None:
        """Queue a fresh entry of each request on its stream for another worker, then ack and delete ours."""

    async def publish_deltas(self, deltas: Sequence[tuple[str, StreamDelta, bool]]) -> None:
        """Append each (request id, delta, first of its attempt) to the request's delta stream and wake its
        followers: one round trip for a whole step."""

    async def streamed(self, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
        """The output tokens an earlier attempt already sent to each request's caller (only ids with any)."""

    async def mark_running(self, requests: Sequence[InferenceRequest], now_ms: int) -> list[bool]:
        """Mark requests running; per request, False when it is already terminal (done or cancelled)."""

    async def consumers(self, stream: str) -> dict[str, int]:
        """{consumer: pending entries} of a stream's group."""

    async def clean_departed(self, streams: Sequence[str], keep: str, idle_s: float) -> int:
        """Delete consumers other than `keep` that own nothing and were idle `idle_s`; returns how many."""

    async def leave(self, consumer: str, streams: Sequence[str]) -> None:
        """Delete `consumer` from each stream's group where it owns nothing any more."""
