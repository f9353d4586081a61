"""Batches in Redis: each batch's record (its `BatchMeta` and `Progress`), the items it has in flight, the
lines it has written, and the lease its runner holds. All of one batch's keys share the slot `{b:<id>}`,
so each step is one atomic script or transaction.

Exactly once: an item is fed (its ref in `items`, the feed position moved past its line) in one
transaction; its line is written (`lines`, HSETNX by line number, counted once, the ref removed) in one
script. A runner that dies between the two leaves the ref, and the next runner resumes it: the native
request is found again by its idempotency key, and a line already written is not written twice.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import redis.asyncio as aioredis

from shared.batches import BatchMeta, ItemRef, Progress, Written
from shared.codec import encode
from shared.ids import created_ms
from shared.keys import Keys
from shared.messages import CallbackDelivery

_META = msgspec.msgpack.Encoder()
_META_DEC = msgspec.msgpack.Decoder(BatchMeta)
_REF_DEC = msgspec.msgpack.Decoder(ItemRef)
LINES_PER_READ = 500

# KEYS: record, items, lines; ARGV: line, ok ("1"/"0"), the line's JSON, expired ("1": a `batch_expired` line),
# its prompt and output tokens
WRITE_LINE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'completed' or status == 'failed' or status == 'cancelled' or status == 'expired' then
  return 0  -- a straggler after the batch ended (its lines hash is gone): it must not count again
end
if redis.call('HSETNX', KEYS[3], ARGV[1], ARGV[2] .. ARGV[3]) == 1 then
  redis.call('HINCRBY', KEYS[1], ARGV[2] == '1' and 'completed' or 'failed', 1)
  if ARGV[4] == '1' then redis.call('HSET', KEYS[1], 'expiring', 1) end
  if tonumber(ARGV[5]) > 0 then redis.call('HINCRBY', KEYS[1], 'in_tokens', ARGV[5]) end
  if tonumber(ARGV[6]) > 0 then redis.call('HINCRBY', KEYS[1], 'out_tokens', ARGV[6]) end
end
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
"""

# KEYS: record; ARGV: the new status, the field of its time, the time, the statuses it may come from...
MOVE_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return nil end
for i = 4, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], 't:' .. ARGV[2], ARGV[3])
    return ARGV[1]
  end
end
return status
"""

# KEYS: lease; ARGV: owner, ttl ms. Take a free lease or renew our own.
LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

# KEYS: lease; ARGV: owner, ttl ms. Renew our own lease only: one that lapsed (another runner may have taken the batch
# over, and even ended it, meanwhile) is lost, not taken again.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


# KEYS: record, lease; ARGV: owner, the final status wanted, now (s). A finalizing attempt begins: if `owner` holds the
# lease and the batch is in progress or cancelling (moved to `finalizing`, its final status recorded) or finalizing
# already (the final status recorded first stays), the attempt's number is counted. Returns {status, attempt, final}
# (attempt 0: none began), nil for no batch.
BEGIN_FINAL_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return nil end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {status, 0, ''} end
if status == 'in_progress' or status == 'cancelling' then
  -- a cancel accepted (`cancelling`) ends the batch `cancelled`, even where its last line finished meanwhile
  local final = ARGV[2]
  if status == 'cancelling' and final == 'completed' then final = 'cancelled' end
  redis.call('HSET', KEYS[1], 'status', 'finalizing', 't:finalizing_at', ARGV[3], 'final', final)
elseif status ~= 'finalizing' then
  return {status, 0, ''}
end
local final = redis.call('HGET', KEYS[1], 'final') or ARGV[2]
return {'finalizing', redis.call('HINCRBY', KEYS[1], 'fin', 1), final}
"""

# KEYS: record, lease; ARGV: owner, attempt, final status, its time field, the time, then field/value pairs. The end:
# only by the latest finalizing attempt, while its runner holds the lease (a runner stalled past its lease, or an
# older attempt, ends nothing).
END_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= 'finalizing' or redis.call('HGET', KEYS[1], 'fin') ~= ARGV[2]
    or redis.call('GET', KEYS[2]) ~= ARGV[1] then
  return 0
end
for i = 6, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[1], 'status', ARGV[3], 't:' .. ARGV[4], ARGV[5])
return 1
"""

class Finalizing(NamedTuple):
    """A finalizing attempt, as `BatchStore.begin_finalize` answers: the batch's status, the attempt's number (0: none
    began, the status says why) and the final status it ends with."""

    status: str | None
    attempt: int
    final: str


@dataclass(slots=True)
class BatchState:
    meta: BatchMeta
    progress: Progress
    next_line: int  # the first input line not fed yet
    next_offset: int  # its byte offset in the input file
    expiring: bool = False  # a line was answered `batch_expired`: the batch ends `expired`
    attempts: int = 0  # finalizing attempts begun (`begin_finalize`)


# KEYS items, batch; ARGV next line, next offset, then (line, item ref) pairs: items in flight and the feed
# position past them, together.
FED_LUA = """
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('HSET', KEYS[2], 'next', ARGV[1], 'offset', ARGV[2])
return 1
"""


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


class BatchStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._write_line = redis.register_script(WRITE_LINE_LUA)
        self._move = redis.register_script(MOVE_LUA)
        self._lease = redis.register_script(LEASE_LUA)
        self._renew = redis.register_script(RENEW_LUA)
        self._fed = redis.register_script(FED_LUA)
        self._begin_final = redis.register_script(BEGIN_FINAL_LUA)
        self._end = redis.register_script(END_LUA)

    async def create(self, meta: BatchMeta) -> None:
        # listed newest first by the millisecond of creation its id holds: ids of one second tie at the second, and
        # their base32 text does not sort by time (its digits 2-7 sort before its letters)
        ms = created_ms("req_" + meta.id.removeprefix("batch_")) or meta.created_at * 1000
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.batch(meta.id), mapping={"m": _META.encode(meta), "status": "validating",
                                                     "next": 0, "offset": 0})
        pipe.zadd(self.keys.batches(meta.tenant), {meta.id: ms})
        pipe.zadd(self.keys.batches_active(), {meta.id: ms})
        await pipe.execute()

    async def get(self, batch_id: str) -> BatchState | None:
        raw = await self.redis.hgetall(self.keys.batch(batch_id))
        if not raw or b"m" not in raw:
            return None
        f = {_text(k): v for k, v in raw.items()}
        p = Progress(status=_text(f["status"]), total=int(f.get("total", 0)), completed=int(f.get("completed", 0)),
                     failed=int(f.get("failed", 0)),
                     output_file_id=_text(f["out_id"]) if "out_id" in f else None,
                     error_file_id=_text(f["err_id"]) if "err_id" in f else None,
                     errors=json.loads(f["errors"]) if "errors" in f else [],
                     times={k[2:]: int(v) for k, v in f.items() if k.startswith("t:")},
                     model=(_text(f["model"]) or None) if "model" in f else None,
                     input_tokens=int(f.get("in_tokens", 0)), output_tokens=int(f.get("out_tokens", 0)))
        return BatchState(_META_DEC.decode(f["m"]), p, int(f.get("next", 0)), int(f.get("offset", 0)),
                          expiring="expiring" in f, attempts=int(f.get("fin", 0)))

    async def ids(self, tenant: str) -> list[str]:
        """The tenant's batches, newest first."""
        return [_text(i) for i in await self.redis.zrevrange(self.keys.batches(tenant), 0, -1)]

    async def active(self) -> list[str]:
        return [_text(i) for i in await self.redis.zrange(self.keys.batches_active(), 0, -1)]

    async def move(self, batch_id: str, status: str, time_field: str, now_s: int, *,
                   from_: tuple[str, ...]) -> str | None:
        """Set the status if the batch is in one of `from_`; the status it has afterwards (None: no batch)."""
        out = await self._move(keys=[self.keys.batch(batch_id)], args=[status, time_field, now_s, *from_])
        return None if out is None else _text(out)

    async def set_fields(self, batch_id: str, **fields: Any) -> None:
        await self.redis.hset(self.keys.batch(batch_id), mapping={k: v for k, v in fields.items() if v is not None})

    async def lease(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        """Take the batch's lease if it is free (or already `owner`'s)."""
        return bool(await self._lease(keys=[self.keys.batch_lease(batch_id)], args=[owner, ttl_ms]))

    async def renew(self, batch_id: str, owner: str, ttl_ms: int) -> bool:
        """Extend `owner`'s lease; False if it is no longer theirs (lapsed, or another runner's now)."""
        return bool(await self._renew(keys=[self.keys.batch_lease(batch_id)], args=[owner, ttl_ms]))

    async def holds(self, batch_id: str, owner: str) -> bool:
        return _text(await self.redis.get(self.keys.batch_lease(batch_id)) or b"") == owner

    async def release(self, batch_id: str, owner: str) -> None:
        if await self.holds(batch_id, owner):
            await self.redis.delete(self.keys.batch_lease(batch_id))

    async def fed(self, batch_id: str, refs: list[ItemRef], next_line: int, next_offset: int) -> None:
        """Items now in flight, and the feed position past them: one script on the batch's slot (atomic on a
        Redis Cluster too, where a pipeline is no transaction)."""
        pairs = [x for r in refs for x in (str(r.line), msgspec.msgpack.encode(r))]
        await self._fed(keys=[self.keys.batch_items(batch_id), self.keys.batch(batch_id)],
                        args=[next_line, next_offset, *pairs])

    async def in_flight(self, batch_id: str) -> list[ItemRef]:
        raw = await self.redis.hgetall(self.keys.batch_items(batch_id))
        return sorted((_REF_DEC.decode(v) for v in raw.values()), key=lambda r: r.line)

    async def write_line(self, batch_id: str, line: int, written: Written) -> None:
        """A line written once (by line number), counted, its ref out of the items in flight: one script."""
        await self._write_line(keys=[self.keys.batch(batch_id), self.keys.batch_items(batch_id),
                                     self.keys.batch_lines(batch_id)],
                               args=[line, "1" if written.ok else "0", json.dumps(written.line, separators=(",", ":")),
                                     "1" if written.expired else "0", *written.tokens])

    async def refed(self, batch_id: str, ref: ItemRef) -> None:
        """A line fed again: its new request in flight in place of the one that expired (the feed position stays)."""
        await self.redis.hset(self.keys.batch_items(batch_id), str(ref.line), msgspec.msgpack.encode(ref))

    async def lines(self, batch_id: str, total: int) -> AsyncIterator[tuple[bool, bytes]]:
        """The written lines in input order: (succeeded, the JSON line)."""
        key = self.keys.batch_lines(batch_id)
        for lo in range(0, total, LINES_PER_READ):
            for v in await self.redis.hmget(key, [str(i) for i in range(lo, min(total, lo + LINES_PER_READ))]):
                if v is not None:
                    yield v[:1] == b"1", v[1:]

    async def begin_finalize(self, batch_id: str, owner: str, final: str, now_s: int) -> Finalizing:
        """Begin a finalizing attempt (see BEGIN_FINAL_LUA): one script on the batch's slot, the lease included."""
        out = await self._begin_final(keys=[self.keys.batch(batch_id), self.keys.batch_lease(batch_id)],
                                      args=[owner, final, now_s])
        return Finalizing(None, 0, "") if out is None else Finalizing(_text(out[0]), int(out[1]), _text(out[2]))

    async def end(self, batch_id: str, owner: str, attempt: int, status: str, time_field: str, now_s: int,
                  **fields: str) -> bool:
        """The batch's final status and `fields` (its files' ids), if `attempt` is its latest finalizing attempt and
        `owner` still holds the lease; whether it ended. Its webhook and the drop of its working state follow (a
        batch ended but still active has them pending: `BatchRunner.after_end`)."""
        pairs = [x for kv in fields.items() for x in kv]
        return bool(await self._end(keys=[self.keys.batch(batch_id), self.keys.batch_lease(batch_id)],
                                    args=[owner, attempt, status, time_field, now_s, *pairs]))

    async def queue_webhook(self, webhook: CallbackDelivery | None) -> None:
        """A batch's webhook onto the callback stream (nothing when the batch named no `callback_url`)."""
        if webhook is not None:
            await self.redis.xadd(self.keys.callback_stream(), {"d": encode(webhook)})

    async def finished(self, batch_id: str) -> None:
        """The batch's files are written: drop its working state (the record stays, as the files' index)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.batch_items(batch_id), self.keys.batch_lines(batch_id))
        pipe.zrem(self.keys.batches_active(), batch_id)
        await pipe.execute()
