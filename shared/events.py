"""A request's events, as a caller follows them: its status changes, its token deltas, its final result.

The worker of a streaming request (`stream: true`) appends each step's newly released tokens to the
request's delta stream (`Keys.events`) and wakes the request's "done" channel, one pipeline per engine
step for all its streaming rows. `follow` turns that, and the request's record, into the events the
gateway serves as Server-Sent Events (`GET /v1/requests/{id}/events`) and the OpenAI routes as chunks:

- `status` `{id, status}`: on connecting, and whenever the status changes (queued -> running: a worker's start of a
  streaming request wakes its followers; one that does not stream says it with its output);
- `delta` `{index, text, token_ids}`: the output's tokens from `index` on and the text they add (and, with
  `params.logprobs`, `logprobs`: an entry per token, as the result's `output.logprobs`);
- `done`: the request's record view (as GET answers), always the last event. Cancelled, expired and
  failed requests end with it too; a worker crash does not (the request runs again and continues).

Every event's SSE id is the number of output tokens sent up to it. A caller that reconnects with that
id (`Last-Event-ID`) gets the deltas after it, never one twice. The deltas a caller sees concatenate to
the final `text` and `token_ids`: what was held back at the end (a stop string's cut, the last tokens)
comes as one last delta, built from the record. A request that did not stream gets its whole output as
that one delta. Deltas are contiguous by construction; one that overlaps what was sent (two attempts of
a request, the first one not dead after all) is dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.codec import decode
from shared.deadlines import cannot_finish
from shared.errors import CodecError
from shared.keys import Keys
from shared.logs import get_logger
from shared.messages import StreamDelta
from shared.records import StoredRecord, parse_record, stream_deltas, streamed_output
from shared.redis_io import raise_if_cancelling
from shared.views import record_view
from shared.waiters import SubscriptionUnavailable

if TYPE_CHECKING:
    from shared.queue_client import QueueClient

log = get_logger(__name__)

RESUBSCRIBE_S = 0.5  # the pub/sub connection could not confirm: read again after this long
STATUS_ORDER = {"queued": 0, "running": 1}  # a status event only ever moves forward


@dataclass(frozen=True, slots=True)
class ServerEvent:
    event: str  # "status" | "delta" | "done"; "" for none (OpenAI's chunks)
    data: dict[str, Any] | str  # a str is sent as it is (OpenAI's "[DONE]"), anything else as JSON
    id: str  # "" for none


def parse_last_event_id(value: str | None) -> int | None:
    """The output tokens a caller already has, from its `Last-Event-ID`; None when it sent none."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if not text.isdigit() or len(text) > 9:
        raise ValueError("Last-Event-ID must be an id this API sent (a token count)")
    return int(text)


@dataclass(slots=True)
class _Cursor:
    """What of the output was sent (tokens and characters) and where in the delta stream reading goes on."""

    tokens: int = 0
    chars: int = 0
    entry: str = "-"
    skip_to: int = 0  # tokens the caller already had when it connected (Last-Event-ID)

    @property
    def position(self) -> str:
        """The id of an event that carries no tokens: the tokens the caller has, so a reconnect from it resumes
        where it is (a resumed stream's opening status must not send it back to 0)."""
        return str(max(self.tokens, self.skip_to))

    def take(self, delta: StreamDelta) -> ServerEvent | None:
        end = delta.start + len(delta.token_ids)
        if delta.start != self.tokens:  # a repeat (or the overlap of a second attempt): never sent twice
            return None
        self.tokens, self.chars = end, self.chars + len(delta.text)
        if end <= self.skip_to:
            return None
        data: dict[str, Any] = {"index": delta.start, "text": delta.text, "token_ids": list(delta.token_ids)}
        if delta.logprobs is not None:
            data["logprobs"] = list(delta.logprobs)
        if delta.prompt_tokens is not None:
            data["prompt_tokens"] = delta.prompt_tokens
        if delta.prompt_token_ids is not None:
            data["prompt_token_ids"] = list(delta.prompt_token_ids)
        return ServerEvent("delta", data, str(end))

    def tail(self, output: dict[str, Any] | None) -> ServerEvent | None:
        """What of the final output was not sent as a delta (all of it for a request that did not stream)."""
        if not output or "token_ids" not in output or "text" not in output:
            return None
        text, ids = output["text"], output["token_ids"]
        rest_text, rest_ids = text[self.chars:], ids[self.tokens:]
        start = self.tokens
        self.tokens, self.chars = len(ids), len(text)
        # a caller that reconnected with every token (`skip_to`) had this tail too; a fresh one (skip_to 0) gets it
        # even with no token in it: text held back and then cut inside the first token is all the output there is
        if (not rest_text and not rest_ids) or (self.skip_to and len(ids) <= self.skip_to):
            return None
        data = {"index": start, "text": rest_text, "token_ids": rest_ids}
        if isinstance(output.get("logprobs"), list):
            data["logprobs"] = output["logprobs"][start:]
        for name in ("prompt_tokens", "prompt_token_ids"):
            if output.get(name) is not None:
                data[name] = output[name]
        return ServerEvent("delta", data, str(len(ids)))


async def _read(q: QueueClient, request_id: str, cursor: _Cursor,
                *, record: bool, stream: bool) -> tuple[StoredRecord | None, list[StreamDelta]]:
    """The record (if `record`), then the deltas after the cursor (if `stream`): one round trip, in that
    order (a terminal record's deltas were all written before it). A record past its deadline is expired
    as `QueueClient.get` does."""
    if not record and not stream:
        return None, []
    pipe = q.redis.pipeline(transaction=False)
    if record:
        pipe.hgetall(q.keys.record(request_id))
    if stream:
        pipe.xrange(q.keys.events(request_id), min=cursor.entry if cursor.entry == "-" else "(" + cursor.entry,
                    max="+")
    replies = await pipe.execute()
    rec = parse_record(request_id, replies[0]) if record else None
    if rec is not None and not rec.terminal and rec.meta is not None and cannot_finish(
            rec.meta.deadline_ms / 1000 + q.settings.expiry_grace_s, q.clock()):
        rec = await q.get(request_id)
    out = []
    for entry_id, fields in replies[-1] if stream else ():
        cursor.entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        try:
            out.append(decode(fields[b"d"], StreamDelta))
        except (CodecError, KeyError):
            log.warning("undecodable stream delta skipped", request_id=request_id, entry=cursor.entry)
    return rec, out


def _received(payloads: list[bytes], cursor: _Cursor) -> list[StreamDelta] | None:
    """The deltas that came with the wake-ups, if they go on from what was sent; None: read the stream."""
    out = []
    at = cursor.tokens
    for raw in payloads:
        try:
            delta = decode(raw, StreamDelta)
        except CodecError:
            return None
        if delta.start + len(delta.token_ids) <= at:
            continue  # one already read
        if delta.start != at:
            return None  # a gap: some were missed
        out.append(delta)
        at = delta.start + len(delta.token_ids)
    return out


async def streamed_tokens(redis: Any, keys: Keys, request_ids: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The output tokens already sent to the callers of these requests (the contiguous deltas from the
    first on), in one round trip; requests with none are left out. A worker running a streaming request
    again continues after these."""
    if not request_ids:
        return {}
    pipe = redis.pipeline(transaction=False)
    for rid in request_ids:
        pipe.xrange(keys.events(rid), min="-", max="+")
    out: dict[str, tuple[int, ...]] = {}
    for rid, entries in zip(request_ids, await pipe.execute(), strict=True):
        if (sent := streamed_output(stream_deltas(entries))) is not None:
            out[rid] = tuple(sent["token_ids"])
    return out


async def tokens_sent(q: QueueClient, rec: StoredRecord) -> int:
    """The most output tokens a caller of `rec`'s events can have been sent: what its stream holds, or its final
    output's (a finished request's replay sends it all, streamed or not). An event id is at most this."""
    output = rec.result.output if rec.terminal and rec.result is not None else None
    done = len(output.get("token_ids") or ()) if isinstance(output, dict) else 0
    return max(done, len((await streamed_tokens(q.redis, q.keys, [rec.id])).get(rec.id, ())))


def _status_now(sent: str | None, tokens_came: bool, fresh: StoredRecord | None) -> str | None:
    """The status to announce now, if it moves past the one `sent`: running once tokens come (the record may
    lag), else what a fresh non-terminal record says (a terminal one is announced by `done`); nothing after a
    terminal one (a finished request's replay)."""
    now = "running" if tokens_came else None
    if now is None and fresh is not None and not fresh.terminal:
        now = fresh.state.value
    if now is None or STATUS_ORDER.get(now, 2) <= (STATUS_ORDER.get(sent, 2) if sent else -1):
        return None
    return now


def _wait_s(q: QueueClient, rec: StoredRecord) -> float:
    """How long a stream waits for a wake-up before reading the record: never past the point where `get()` expires
    the request."""
    if rec.meta is None:
        return 5.0
    return max(0.0, rec.meta.deadline_ms / 1000 + q.settings.expiry_grace_s - q.clock()) + 0.05


async def follow(q: QueueClient, rec: StoredRecord, after: int | None = None,
                 sent: str | None = None) -> AsyncIterator[ServerEvent]:
    """The events of request `rec` (already checked visible to the caller) until its `done` event.

    `after`: output tokens the caller already has (from `Last-Event-ID`); `sent`: the status already announced
    (else the stream opens with `rec`'s, then moves forward, never between deltas). Woken by the request's "done"
    channel (deltas and the result both publish on it), never by polling; bounded by the request's
    deadline (plus the expiry grace), when reading it ends it `expired`."""
    await q.hub.ensure_started()
    cursor = _Cursor(skip_to=after or 0)
    request_id = rec.id
    status = sent
    try:
        async with q.hub.subscribe(q.keys.done_channel(request_id)) as sub:
            if status is None:  # opens with what the caller saw (queued, from a submit); a finished request's
                status = rec.state.value  # replay with its deltas, then `done` saying how it ended, as a request
                if not rec.terminal:  # that did not stream gets them (its deltas are not "running" again)
                    yield ServerEvent("status", {"id": request_id, "status": status}, cursor.position)
            while True:
                raise_if_cancelling()  # a caller gone while a read completed: stop here, not at the deadline
                # the deltas come with their wake-ups: the stream is read only when some may have been missed
                # (the first read, a reconnect, a gap); the record only when something else woke us (a
                # result, a reconnect, the deadline's timeout)
                payloads, missed = sub.take_deltas()
                got = None if missed else _received(payloads, cursor)
                fresh, new = await _read(q, request_id, cursor, record=sub.take_record_due(), stream=got is None)
                new = got if got is not None else new
                rec = fresh or rec
                now = _status_now(status, bool(new), fresh)
                if now is not None:  # before the deltas it explains
                    status = now
                    yield ServerEvent("status", {"id": request_id, "status": status}, cursor.position)
                for delta in new:
                    event = cursor.take(delta)
                    if event is not None:
                        yield event
                if rec.terminal:
                    tail = cursor.tail(rec.result.output if rec.result else None)
                    if tail is not None:
                        yield tail
                    yield ServerEvent("done", record_view(rec), cursor.position)
                    return
                sub.raise_if_released()  # the gateway is shutting down: what there was went out
                if not await sub.wait(_wait_s(q, rec)):
                    sub.record_due = sub.missed = True
    except SubscriptionUnavailable:
        # no pub/sub: read at a slow pace instead of not at all (Redis is unreachable or overloaded)
        await asyncio.sleep(RESUBSCRIBE_S)
        async for event in follow(q, rec, cursor.tokens if cursor.tokens > cursor.skip_to else after, status):
            yield event
