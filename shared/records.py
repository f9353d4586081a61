"""The result record of a request: the source of truth for its state, read by every waiter.

Record = one hash at `Keys.record(id)`:
  state    queued | running | succeeded | failed | expired | cancelled
  meta     msgpack RequestMeta (written at submit, or by the worker if it gets there first)
  result   msgpack RequestResult (terminal states only)
  started  ms epoch when a worker started computing it
  attempts how many times a worker started computing it (more than 1 only after a worker died)
  ob:<event> a webhook delivery written with the state change, not yet on the callback stream (the outbox)
Rules, enforced by the Lua scripts below and the queued record's HSETNX (each touches one key, so they are Redis
Cluster safe):
- the first terminal write wins; later ones are no-ops and publish nothing;
- the terminal write and the "done" event are one atomic step (no window where a waiter can read
  a non-terminal record and then miss the event);
- the queued record never overwrites a state a worker already wrote;
- a webhook is queued with the state change that causes it: into the record's own outbox, in the same
  script. The callback stream lives in another Cluster slot (`{cb}`), so the writer moves the outbox to
  the stream right after (`flush`): XADD, then HDEL. A writer that dies in between leaves the outbox to
  whoever settles the request's stream entry next (`sweep`: every entry of a terminal record is
  acked only after its outbox is flushed). A delivery moved twice is scheduled once (its id is fixed,
  and `CallbackStore.schedule` keeps the first), so a webhook is neither lost nor sent twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.codec import decode, encode
from shared.deadlines import cannot_finish
from shared.errors import CodecError
from shared.keys import Keys
from shared.messages import (
    CallbackDelivery,
    CallbackState,
    ErrorInfo,
    InferenceRequest,
    RequestMeta,
    RequestResult,
    StreamDelta,
)
from shared.redis_io import check_replicated, in_pipeline, script_groups, wait_replicas
from shared.states import TERMINAL, FinishReason, Status

RECORD_EVENT = b"r"  # a done event that carries the terminal record (see FINISH_LUA)
KEEP_TTL_SHARE = 0.1  # a finish near its deadline keeps the record's TTL: results kept at most 10% longer
RECORD_EVENT_MAX_BYTES = 65_536  # larger results are read from the record, not sent on every node of a cluster
OUTBOX_EVENTS = ("started", "completed")  # the webhooks a record's own scripts queue
WON, DELTAS_MOVED = 1, -1  # what FINISH_LUA answers for a write that won, and one whose deltas moved on
UNANSWERED_TRIES = 5  # reads of the deltas an end no worker answered makes, while a late worker still writes them
TERMINAL_LUA = "{" + ", ".join(f"['{s.value}']=true" for s in TERMINAL) + "}"


# KEYS records; ARGV started_ms, then for each record: meta, ttl_ms, "started" delivery or '', its done channel or ''.
# Returns each record's state after the call. One read and one write a record in the common case: the meta is
# written where the record lacks it, the TTL only where the record is missing or lacks its meta (a submit's pipeline
# writes the state, the TTL, then the meta: a record with its meta has its TTL). With a channel (a streaming
# request), a start wakes the request's followers, whose streams announce `running` when it starts, not with its
# first tokens (a long prefill, or text held back, said `queued` until then); others publish nothing.
START_LUA = f"""
local terminal = {TERMINAL_LUA}
local out = {{}}
for i, key in ipairs(KEYS) do
  local at = 4 * i - 2
  local cur = redis.call('HMGET', key, 'state', 'attempts', 'meta')
  local s = cur[1]
  if s and terminal[s] then
    out[i] = s
  else
    local f = {{'state', 'running', 'started', ARGV[1], 'attempts', (tonumber(cur[2]) or 0) + 1}}
    if s ~= 'running' and ARGV[at + 2] ~= '' then f[#f + 1] = 'ob:started'; f[#f + 1] = ARGV[at + 2] end
    if not cur[3] then f[#f + 1] = 'meta'; f[#f + 1] = ARGV[at] end
    redis.call('HSET', key, unpack(f))
    if not (s and cur[3]) then redis.call('PEXPIRE', key, ARGV[at + 1]) end
    if s ~= 'running' and ARGV[at + 3] ~= '' then redis.call('PUBLISH', ARGV[at + 3], 'running') end
    out[i] = 'running'
  end
end
return out
"""

# KEYS records: each one still `running` (a worker handing it back) is `queued` again, its start time gone, so
# whoever reads it meanwhile sees a request waiting, not one running on a worker that is gone. Returns how many.
REQUEUE_LUA = """
local n = 0
for _, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'state') == 'running' then
    redis.call('HSET', key, 'state', 'queued')
    redis.call('HDEL', key, 'started')
    n = n + 1
  end
end
return n
"""

# KEYS records; for each record 10 ARGV: state, result, ttl_ms, keep ('1': a record with its state and meta keeps
# the TTL it has), channel, meta, "completed" delivery or '', the state it must be in or '' (any not terminal), its
# delta stream (the same slot) or '', and how many deltas the output was made of (a write of what a caller was
# streamed: `RecordStore.end_unanswered`). Returns 1 for each write that won, 0 where the record had ended (or was
# not in that state), -1 where its delta stream holds another count (a delta written meanwhile: read again). A
# record's result, its done event and its webhook delivery (into the outbox) are one atomic step: a request
# completes once, its event is published once, its callback is queued once. The event carries the terminal record
# when the result is small, so a waiter answers without reading the record back: `RECORD_EVENT`, then state,
# result, meta, started, attempts, cb, each as `<length>:<bytes>`, or `-` where the record lacks it.
FINISH_LUA = f"""
local terminal = {TERMINAL_LUA}
local out = {{}}
for i, key in ipairs(KEYS) do
  local a = 10 * i - 9
  local state, result, channel, meta_arg, done = ARGV[a], ARGV[a + 1], ARGV[a + 4], ARGV[a + 5], ARGV[a + 6]
  local only, deltas = ARGV[a + 7], ARGV[a + 8]
  local cur = redis.call('HMGET', key, 'state', 'meta', 'started', 'attempts', 'cb')
  local s = cur[1]
  if (s and terminal[s]) or (only ~= '' and s ~= only) then
    out[i] = 0
  elseif deltas ~= '' and redis.call('XLEN', deltas) ~= tonumber(ARGV[a + 9]) then
    out[i] = -1
  else
    local f = {{'state', state, 'result', result}}
    if done ~= '' then f[#f + 1] = 'ob:completed'; f[#f + 1] = done end
    if not cur[2] and meta_arg ~= '' then f[#f + 1] = 'meta'; f[#f + 1] = meta_arg end
    redis.call('HSET', key, unpack(f))
    if not (ARGV[a + 3] == '1' and s and cur[2]) then redis.call('PEXPIRE', key, ARGV[a + 2]) end
    if #result <= {RECORD_EVENT_MAX_BYTES} then
      local meta = cur[2] or (meta_arg ~= '' and meta_arg) or false
      local ev = {{'{RECORD_EVENT.decode()}'}}
      for _, v in ipairs({{state, result, meta, cur[3] or false, cur[4] or false, cur[5] or false}}) do
        ev[#ev + 1] = v and (#v .. ':' .. v) or '-'
      end
      redis.call('PUBLISH', channel, table.concat(ev))
    else
      redis.call('PUBLISH', channel, state)
    end
    out[i] = 1
  end
end
return out
"""

# KEYS[1] record, KEYS[2] its delta stream (the same slot); ARGV callback state, its event, keep ms. Keeps the
# record's view of its webhooks current (if it still exists): the latest delivery's state ('cb') and each event's
# ('cb:<event>': a started webhook that died stays visible, and replayable, after the completed one was delivered);
# and keeps the record, and a streaming request's deltas with it, at least `keep` ms longer (never shorter; a key
# without a TTL keeps none).
CALLBACK_STATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'cb', ARGV[1], 'cb:' .. ARGV[2], ARGV[1])
local keep = tonumber(ARGV[3])
for _, key in ipairs(KEYS) do
  local ttl = redis.call('PTTL', key)
  if keep > 0 and ttl >= 0 and ttl < keep then redis.call('PEXPIRE', key, keep) end
end
return 1
"""


@dataclass(frozen=True, slots=True)
class StoredRecord:
    id: str
    state: Status
    meta: RequestMeta | None
    result: RequestResult | None
    started_ms: int | None
    attempts: int = 0
    callback: CallbackState | None = None  # the latest delivery's
    deliveries: tuple[CallbackState, ...] = ()  # each event's latest delivery, in the order the events happen

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


def streamed_output(deltas: Sequence[StreamDelta]) -> dict[str, Any] | None:
    """The output a streaming request's caller was sent (its deltas contiguous from the first; a repeat, or a
    second attempt's overlap, left out), in the shape of a result's `output`; None when no token was sent."""
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[dict[str, Any]] | None = []
    prompt_tokens = prompt_ids = None
    for d in deltas:
        if d.start != len(ids):
            continue
        text.append(d.text)
        ids.extend(d.token_ids)
        prompt_tokens = d.prompt_tokens if prompt_tokens is None else prompt_tokens
        prompt_ids = d.prompt_token_ids if prompt_ids is None else prompt_ids  # (with `params.echo`)
        logprobs = None if logprobs is None or d.logprobs is None else [*logprobs, *d.logprobs]
    if not ids:
        return None
    out: dict[str, Any] = {"text": "".join(text), "token_ids": ids, "completion_tokens": len(ids)}
    if prompt_tokens is not None:
        out["prompt_tokens"] = prompt_tokens
    if prompt_ids is not None:
        out["prompt_token_ids"] = list(prompt_ids)
    if logprobs:
        out["logprobs"] = logprobs
    return out


def stream_deltas(entries: Sequence[tuple[Any, dict[bytes, bytes]]]) -> list[StreamDelta]:
    """The deltas of a request's delta stream as XRANGE reads them."""
    out = []
    for _, fields in entries:
        try:
            out.append(decode(fields[b"d"], StreamDelta))
        except (CodecError, KeyError):
            continue  # one a later worker's schema wrote: the deltas after it are not contiguous, so not counted
    return out


class RecordStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, result_ttl_s: int, *, wait_replicas: int = 0,
                 wait_ms: int = 1000) -> None:
        self.redis = redis
        self.keys = keys
        self.result_ttl_ms = result_ttl_s * 1000
        # durable results (`Settings.redis_wait_replicas`): a result counts as written once this many replicas
        # have it, so its request's entry is acked only then (a failover before that re-runs it, loses nothing)
        self.wait_replicas = wait_replicas
        self.wait_ms = wait_ms
        self._cb_state = redis.register_script(CALLBACK_STATE_LUA)

    def queued_ttl_ms(self, req: InferenceRequest, now_ms: int) -> int:
        """A queued record lives until its deadline, plus the result TTL."""
        return max(0, req.deadline_ms - now_ms) + self.result_ttl_ms

    async def init_in(self, pipe: aioredis.client.Pipeline, req: InferenceRequest, now_ms: int) -> None:
        """Queue the queued-record write on a pipeline (after the XADD of the same request): the state if the record
        has none (a worker may have got there first, on a cluster where the stream is on another node), the TTL,
        then the meta if the record has none. Three plain commands, no script; the first one's reply is 1 if this
        call created the record. A TTL set again over a worker's later one only keeps a result longer (until its
        deadline, plus the result TTL); a record that lacks its meta or TTL after an interrupted pipeline gets
        them from the worker's scripts."""
        key = self.keys.record(req.id)
        pipe.hsetnx(key, "state", Status.QUEUED.value)
        pipe.pexpire(key, self.queued_ttl_ms(req, now_ms))
        pipe.hsetnx(key, "meta", encode(req.meta()))  # last: a record with its meta has its TTL (see START_LUA)

    async def get(self, request_id: str) -> StoredRecord | None:
        raw = await self.redis.hgetall(self.keys.record(request_id))
        return parse_record(request_id, raw)

    async def start(self, reqs: list[InferenceRequest], started_ms: int) -> list[Status]:
        """Mark requests running (unless already terminal); returns each one's state afterwards. A "started"
        webhook is queued with the first start (and moved to the callback stream before this returns). One script
        call for all the records (for each hash slot's, on a cluster)."""
        if not reqs:
            return []
        started = [delivery_for(req.meta(), "started", started_ms) for req in reqs]
        groups = script_groups(self.redis, [self.keys.record(req.id) for req in reqs])
        pipe = self.redis.pipeline(transaction=False)
        for group in groups:
            args: list[Any] = [started_ms]
            for i in group:
                d = started[i]
                args += [encode(reqs[i].meta()), self.queued_ttl_ms(reqs[i], started_ms), encode(d) if d else b"",
                         self.keys.done_channel(reqs[i].id) if reqs[i].stream else ""]
            in_pipeline(pipe, START_LUA, [self.keys.record(reqs[i].id) for i in group], args)
        states = ungroup(groups, await pipe.execute(), len(reqs))
        states = [Status(_text(s)) for s in states]
        # a start after a crash finds its outbox flushed or not: moving the delivery again is harmless
        await self.flush([d for d, s in zip(started, states, strict=True) if d is not None and s is Status.RUNNING])
        return states

    def _finish_args(self, result: RequestResult, meta: RequestMeta | None, only_if: str = "",
                     deltas: tuple[str, int] | None = None) -> list[Any]:
        done = completed_delivery(result, meta)
        # The record lives until its deadline plus the result TTL (`queued_ttl_ms`); where that deadline is near,
        # the record keeps it (the result is kept at most `KEEP_TTL_SHARE` longer than the result TTL) and the
        # finish saves a PEXPIRE. A deadline already past would keep it shorter: the TTL is set.
        keep = meta is not None and 0 <= meta.deadline_ms - result.finished_ms <= self.result_ttl_ms * KEEP_TTL_SHARE
        return [result.status.value, encode(result), self.result_ttl_ms, "1" if keep else "",
                self.keys.done_channel(result.id), encode(meta) if meta else b"", encode(done) if done else b"",
                only_if, *(deltas or ("", ""))]

    async def finish(self, result: RequestResult, meta: RequestMeta | None = None, *,
                     only_if: Status | None = None) -> bool:
        """Write a terminal result, publish "done" and queue the webhook, atomically; then move the webhook to the
        callback stream. True if this write won. `only_if`: only while the record is in that state (else False)."""
        return await self._finish_one(result, meta, only_if) == WON

    async def _finish_one(self, result: RequestResult, meta: RequestMeta | None, only_if: Status | None = None,
                          deltas: tuple[str, int] | None = None) -> int:
        (code,) = await self._finish_codes([(result, meta)], only_if=only_if, deltas=deltas)
        if code == WON and (done := completed_delivery(result, meta)) is not None:
            await self.flush([done])
        return code

    @staticmethod
    def expiry_due_ms(deadline_ms: int, grace_s: float) -> int:
        """When a request with no result may be expired: its deadline plus the grace a worker gets to write one."""
        return deadline_ms + int(grace_s * 1000)

    async def expire_overdue(self, rec: StoredRecord, now_ms: int, grace_s: float, by: str) -> bool:
        """Write `expired` for a request whose deadline, plus the grace a worker gets to write a result, passed
        with none (with its meta, its `completed` webhook is queued as for any other end). False if not due yet,
        already ended, or another write won."""
        if rec.terminal or rec.meta is None or not cannot_finish(rec.meta.deadline_ms / 1000 + grace_s, now_ms / 1000):
            return False
        expired = ErrorInfo("deadline_exceeded", "no result by the deadline")
        return await self.end_unanswered(rec, Status.EXPIRED, expired, now_ms, by)

    async def end_unanswered(self, rec: StoredRecord, status: Status, error: ErrorInfo, now_ms: int, by: str, *,
                             only_if: Status | None = None) -> bool:
        """End a request no worker writes the result of (an expiry past the grace, a cancel no worker answered):
        what its caller was streamed is its output, as a worker's own cut keeps it, so the deltas still add up to
        the final output. True if this write won; `only_if`: only while the record is in that state. A worker that
        writes a delta between the read of the deltas and the write (one still running, late) makes the write read
        them again (`DELTAS_MOVED`); one that goes on past `UNANSWERED_TRIES` reads ends nothing (False): it is
        alive, and its own deadline cut ends it."""
        events = self.keys.events(rec.id)
        reason = FinishReason.DEADLINE if status is Status.EXPIRED else FinishReason.CANCELLED
        for _ in range(UNANSWERED_TRIES):
            entries = await self.redis.xrange(events)
            output = streamed_output(stream_deltas(entries))
            said = error
            if output is not None:
                said = ErrorInfo(error.code, f"{error.message} after {output['completion_tokens']} tokens were "
                                             "streamed; partial output kept")
            result = RequestResult(id=rec.id, status=status, output=output, finish_reason=reason, error=said,
                                   finished_ms=now_ms, worker=by)
            code = await self._finish_one(result, rec.meta, only_if, (events, len(entries)))
            if code != DELTAS_MOVED:
                break
        won = code == WON
        if won and output is not None:
            # the deltas live as long as the record did; a record ended late (an expiry no dispatcher ran meanwhile)
            # now outlives that: they are kept as long as its result, so a stream resumed from its last event id
            # is sent what follows it, not the whole output again
            await self.redis.pexpire(self.keys.events(rec.id), self.result_ttl_ms)
        return won

    async def finish_all(self, finished: Sequence[tuple[RequestResult, RequestMeta | None]], *,
                         durable: bool = True, only_if: Status | None = None) -> list[bool]:
        """Write terminal results (see `finish`), one script call for all (for each hash slot's, on a cluster);
        True for each write that won. The caller then passes the winners' deliveries (`completed_delivery`) to
        `flush`, before it acks their stream entries. `durable` False: not waited on the replicas for, whatever the
        setting (a write whose caller was already answered)."""
        return [code == WON for code in await self._finish_codes(finished, durable=durable, only_if=only_if)]

    async def _finish_codes(self, finished: Sequence[tuple[RequestResult, RequestMeta | None]], *,
                            durable: bool = True, only_if: Status | None = None,
                            deltas: tuple[str, int] | None = None) -> list[int]:
        if not finished:
            return []
        groups = script_groups(self.redis, [self.keys.record(result.id) for result, _ in finished])
        pipe = self.redis.pipeline(transaction=False)
        only = only_if.value if only_if else ""
        for group in groups:
            in_pipeline(pipe, FINISH_LUA, [self.keys.record(finished[i][0].id) for i in group],
                        [arg for i in group for arg in self._finish_args(*finished[i], only, deltas)])
        return [int(c) for c in ungroup(groups, await (self.execute_durably(pipe) if durable else pipe.execute()),
                                        len(finished))]

    async def execute_durably(self, pipe: Any) -> list[Any]:
        """Execute a pipeline of writes; with durable results on, only once they reached the replicas (else
        `NotReplicated`, a connection error: the caller retries, or answers 503)."""
        wait_replicas(pipe, self.wait_replicas, self.wait_ms)
        return check_replicated(await pipe.execute(), pipe, self.wait_replicas)

    async def flush(self, deliveries: Sequence[CallbackDelivery]) -> None:
        """Move webhook deliveries from their records' outboxes to the callback stream: XADD, then HDEL. A
        `completed` one takes its request off the dispatcher's deadlines (the same slot): nothing left to expire."""
        if not deliveries:
            return
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.xadd(self.keys.callback_stream(), {"d": encode(d)})
            if d.event == "completed":
                pipe.zrem(self.keys.callback_deadlines(), d.request_id)
        await pipe.execute()
        pipe = self.redis.pipeline(transaction=False)
        for d in deliveries:
            pipe.hdel(self.keys.record(d.request_id), f"ob:{d.event}")
        await pipe.execute()

    async def requeue(self, request_ids: Sequence[str]) -> None:
        """Mark handed-back requests `queued` again (those still `running`): one script call per hash slot."""
        if not request_ids:
            return
        keys = [self.keys.record(rid) for rid in request_ids]
        pipe = self.redis.pipeline(transaction=False)
        for group in script_groups(self.redis, keys):
            in_pipeline(pipe, REQUEUE_LUA, [keys[i] for i in group], [])
        await pipe.execute()

    async def sweep(self, request_ids: Sequence[str]) -> int:
        """Flush what a writer that died between its state change and its `flush` left in these requests'
        outboxes. Called before their stream entries are acked, so no outbox outlives its last entry. Returns
        the number of deliveries moved."""
        if not request_ids:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        for rid in request_ids:
            pipe.hmget(self.keys.record(rid), [f"ob:{event}" for event in OUTBOX_EVENTS])
        found = [decode(raw, CallbackDelivery) for row in await pipe.execute() for raw in row if raw]
        await self.flush(found)
        return len(found)

    def callback_keep_ms(self, state: CallbackState, now_ms: int) -> int:
        """How much longer a record must live for its delivery in `state`: one still to be attempted until its next
        attempt, plus the result TTL; one that ended undelivered (dead, failed, disabled) the result TTL from now, so
        its caller can still read the result and replay it. A delivered one adds nothing (the retry schedule, about
        two hours by default, outlived the one-hour result: late attempts and dead letters found no record, sent
        ids only, and could not be replayed)."""
        if state.status == "delivered":
            return 0
        return max(0, (state.next_attempt_ms or now_ms) - now_ms) + self.result_ttl_ms

    async def set_callback_state(self, request_id: str, state: CallbackState, now_ms: int) -> None:
        """Write a delivery's state into its request's record, keeping the record as `callback_keep_ms` says."""
        await self._cb_state(keys=[self.keys.record(request_id), self.keys.events(request_id)],
                             args=[encode(state), state.event, self.callback_keep_ms(state, now_ms)])


def ungroup(groups: list[list[int]], replies: Sequence[Any], n: int) -> list[Any]:
    """Each item's reply, from one reply (a list) per group of `script_groups`."""
    out: list[Any] = [None] * n
    for group, reply in zip(groups, replies, strict=True):
        for i, value in zip(group, reply, strict=True):
            out[i] = value
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_record(request_id: str, raw: dict[bytes, bytes]) -> StoredRecord | None:
    if not raw or b"state" not in raw:
        return None
    meta = decode(raw[b"meta"], RequestMeta) if b"meta" in raw else None
    result = decode(raw[b"result"], RequestResult) if b"result" in raw else None
    started = int(raw[b"started"]) if b"started" in raw else None
    callback = decode(raw[b"cb"], CallbackState) if b"cb" in raw else None
    deliveries = tuple(decode(raw[f"cb:{event}".encode()], CallbackState) for event in OUTBOX_EVENTS
                       if f"cb:{event}".encode() in raw)
    return StoredRecord(id=request_id, state=Status(_text(raw[b"state"])), meta=meta, result=result,
                        started_ms=started, attempts=int(raw.get(b"attempts", 0)), callback=callback,
                        deliveries=deliveries or ((callback,) if callback else ()))


RECORD_FIELDS = (b"state", b"result", b"meta", b"started", b"attempts", b"cb")  # in a record event, in order


def record_from_event(request_id: str, payload: bytes) -> StoredRecord | None:
    """The terminal record a done event carries (`RECORD_EVENT` stripped); None if it is not one."""
    raw: dict[bytes, bytes] = {}
    at = 0
    try:
        for name in RECORD_FIELDS:
            if payload[at:at + 1] == b"-":
                at += 1
                continue
            colon = payload.index(b":", at)
            end = colon + 1 + int(payload[at:colon])
            raw[name] = payload[colon + 1:end]
            at = end
        rec = parse_record(request_id, raw) if at == len(payload) else None
    except (ValueError, CodecError):
        return None
    return rec if rec is not None and rec.terminal else None


def completed_delivery(result: RequestResult, meta: RequestMeta | None) -> CallbackDelivery | None:
    """The "completed" webhook a terminal result queues, if its request asked for one."""
    return delivery_for(meta, "completed", result.finished_ms) if meta else None


def delivery_for(meta: RequestMeta | None, event: str, now_ms: int) -> CallbackDelivery | None:
    """The webhook delivery an event produces, if the request asked for one."""
    if meta is None or meta.callback is None or event not in meta.callback.events:
        return None
    return CallbackDelivery(delivery_id=f"msg_{meta.id.removeprefix('req_')}_{event}", request_id=meta.id,
                            tenant=meta.tenant, event=event, url=meta.callback.url, created_ms=now_ms)
