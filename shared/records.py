"""The result record of a request: the source of truth for its state, read by every waiter.

Record = one hash at `Keys.record(id)`:
  state    queued | running | succeeded | failed | expired | cancelled
  meta     msgpack RequestMeta (written at submit, or by the worker if it gets there first)
  result   msgpack RequestResult (terminal states only)
  started  ms epoch when a worker started computing it
  attempts how many times a worker started computing it (more than 1 only after a worker died)
Rules, enforced by the Lua scripts below (each touches one key, so they are Redis Cluster safe):
- the first terminal write wins; later ones are no-ops and publish nothing;
- the terminal write and the "done" event are one atomic step (no window where a waiter can read
  a non-terminal record and then miss the event);
- the queued record never overwrites a state a worker already wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.codec import decode, encode
from shared.keys import Keys
from shared.messages import CallbackDelivery, CallbackState, InferenceRequest, RequestMeta, RequestResult
from shared.states import TERMINAL, Status

_TERMINAL_LUA = "{" + ", ".join(f"['{s.value}']=true" for s in TERMINAL) + "}"

# KEYS[1] record; ARGV meta, ttl_ms
INIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'state', 'queued', 'meta', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS[1] record, KEYS[2] callback stream; ARGV started_ms, meta, ttl_ms, "started" delivery or ''.
# Returns the state after the call.
START_LUA = f"""
local terminal = {_TERMINAL_LUA}
local s = redis.call('HGET', KEYS[1], 'state')
if s and terminal[s] then return s end
if s ~= 'running' and ARGV[4] ~= '' then redis.call('XADD', KEYS[2], '*', 'd', ARGV[4]) end
redis.call('HSET', KEYS[1], 'state', 'running', 'started', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSETNX', KEYS[1], 'meta', ARGV[2])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return 'running'
"""

# KEYS[1] record, KEYS[2] callback stream; ARGV state, result, ttl_ms, channel, meta, "completed"
# delivery or ''. Returns 1 if this write won. The result, the done event and the webhook delivery are
# one atomic step: a request completes once, its event is published once, its callback is queued once.
FINISH_LUA = f"""
local terminal = {_TERMINAL_LUA}
local s = redis.call('HGET', KEYS[1], 'state')
if s and terminal[s] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[1], 'result', ARGV[2])
if ARGV[5] ~= '' then redis.call('HSETNX', KEYS[1], 'meta', ARGV[5]) end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[1])
if ARGV[6] ~= '' then redis.call('XADD', KEYS[2], '*', 'd', ARGV[6]) end
return 1
"""

# KEYS[1] record; ARGV callback state. Keeps the record's view of its webhook current (if it still exists).
CALLBACK_STATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'cb', ARGV[1])
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
    callback: CallbackState | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


class RecordStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, result_ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.result_ttl_ms = result_ttl_s * 1000
        self._init = redis.register_script(INIT_LUA)
        self._start = redis.register_script(START_LUA)
        self._finish = redis.register_script(FINISH_LUA)
        self._cb_state = redis.register_script(CALLBACK_STATE_LUA)

    def queued_ttl_ms(self, req: InferenceRequest, now_ms: int) -> int:
        """A queued record lives until its deadline, plus the result TTL."""
        return max(0, req.deadline_ms - now_ms) + self.result_ttl_ms

    async def init_in(self, pipe: aioredis.client.Pipeline, req: InferenceRequest, now_ms: int) -> None:
        """Queue the queued-record write on a pipeline (after the XADD of the same request)."""
        await self._init(keys=[self.keys.record(req.id)],
                   args=[encode(req.meta()), self.queued_ttl_ms(req, now_ms)], client=pipe)

    async def get(self, request_id: str) -> StoredRecord | None:
        raw = await self.redis.hgetall(self.keys.record(request_id))
        return parse_record(request_id, raw)

    async def start(self, reqs: list[InferenceRequest], started_ms: int) -> list[Status]:
        """Mark requests running (unless already terminal); returns each one's state afterwards."""
        if not reqs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for req in reqs:
            started = delivery_for(req.meta(), "started", started_ms)
            await self._start(keys=[self.keys.record(req.id), self.keys.callback_stream()],
                              args=[started_ms, encode(req.meta()), self.queued_ttl_ms(req, started_ms),
                                    encode(started) if started else b""],
                              client=pipe)
        states = await pipe.execute()
        return [Status(_text(s)) for s in states]

    def _finish_args(self, result: RequestResult, meta: RequestMeta | None) -> dict[str, list[Any]]:
        done = delivery_for(meta, "completed", result.finished_ms) if meta else None
        return {"keys": [self.keys.record(result.id), self.keys.callback_stream()],
                "args": [result.status.value, encode(result), self.result_ttl_ms, self.keys.done_channel(result.id),
                         encode(meta) if meta else b"", encode(done) if done else b""]}

    async def finish(self, result: RequestResult, meta: RequestMeta | None = None) -> bool:
        """Write a terminal result, publish "done" and queue the webhook, atomically. True if this write won."""
        return bool(await self._finish(**self._finish_args(result, meta)))

    async def finish_in(self, pipe: aioredis.client.Pipeline, result: RequestResult,
                        meta: RequestMeta | None = None) -> None:
        """Queue a finish (see `finish`) on a pipeline."""
        await self._finish(**self._finish_args(result, meta), client=pipe)

    async def set_callback_state(self, request_id: str, state: CallbackState) -> None:
        await self._cb_state(keys=[self.keys.record(request_id)], args=[encode(state)])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def parse_record(request_id: str, raw: dict[bytes, bytes]) -> StoredRecord | None:
    if not raw or b"state" not in raw:
        return None
    meta = decode(raw[b"meta"], RequestMeta) if b"meta" in raw else None
    result = decode(raw[b"result"], RequestResult) if b"result" in raw else None
    started = int(raw[b"started"]) if b"started" in raw else None
    callback = decode(raw[b"cb"], CallbackState) if b"cb" in raw else None
    return StoredRecord(id=request_id, state=Status(_text(raw[b"state"])), meta=meta, result=result,
                        started_ms=started, attempts=int(raw.get(b"attempts", 0)), callback=callback)


def delivery_for(meta: RequestMeta | None, event: str, now_ms: int) -> CallbackDelivery | None:
    """The webhook delivery an event produces, if the request asked for one."""
    if meta is None or meta.callback is None or event not in meta.callback.events:
        return None
    return CallbackDelivery(delivery_id=f"msg_{meta.id.removeprefix('req_')}_{event}", request_id=meta.id,
                            tenant=meta.tenant, event=event, url=meta.callback.url, created_ms=now_ms)
