"""The durable webhook schedule in Redis (all keys in the `{cb}` slot, so each move is one script).

- `bg:{cb}:stream`   deliveries queued by the finish/start scripts (consumer group "dispatchers");
- `bg:{cb}:due`      sorted set: delivery id -> when its next attempt is due (ms); a claimed delivery's
                     score is pushed to the end of its lease, so a dispatcher that dies mid-attempt gives
                     it back by itself and a restart never resets the schedule;
- `bg:{cb}:d:<id>`   the delivery and its state (attempts, last status, next attempt);
- `bg:{cb}:dead`     deliveries that used up their attempts (replayable);
- `bg:{cb}:off:<t>`  callback URLs a tenant's receiver disabled with 410.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.codec import decode, encode
from shared.keys import Keys
from shared.messages import REPLAYABLE, CallbackDelivery, CallbackState

GROUP = "dispatchers"
FINAL_TTL_MS = 7 * 24 * 3600 * 1000
DEAD_MAXLEN = 10_000

# KEYS state, due, stream; ARGV delivery, state, now_ms, entry id, group, delivery id
SCHEDULE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'delivery', ARGV[1], 'state', ARGV[2])
  redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[6])
end
redis.call('XACK', KEYS[3], ARGV[5], ARGV[4])
redis.call('XDEL', KEYS[3], ARGV[4])
return 1
"""

# KEYS due; ARGV now_ms, lease_until_ms, limit. Claims due deliveries by pushing them to the lease end.
CLAIM_LUA = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, id in ipairs(ids) do redis.call('ZADD', KEYS[1], 'XX', ARGV[2], id) end
return ids
"""

# KEYS state, due, dead; ARGV state, delivery id, next due ms or '', dead '1'|'0', final ttl ms
RESULT_LUA = """
redis.call('HSET', KEYS[1], 'state', ARGV[1])
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
else
  redis.call('ZREM', KEYS[2], ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
end
if ARGV[4] == '1' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'id', ARGV[2], 'd', redis.call('HGET', KEYS[1], 'delivery'))
end
return 1
"""


class CallbackStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._schedule = redis.register_script(SCHEDULE_LUA)
        self._claim = redis.register_script(CLAIM_LUA)
        self._result = redis.register_script(RESULT_LUA)

    async def schedule(self, entry_id: bytes, delivery: CallbackDelivery, now_ms: int) -> None:
        """Move a queued delivery from the stream to the schedule (idempotent; acks the entry)."""
        state = CallbackState(delivery.delivery_id, delivery.event, delivery.url, "pending", next_attempt_ms=now_ms)
        await self._schedule(
            keys=[self.keys.callback_state(delivery.delivery_id), self.keys.callback_due(),
                  self.keys.callback_stream()],
            args=[encode(delivery), encode(state), now_ms, entry_id, GROUP, delivery.delivery_id])

    async def claim_due(self, now_ms: int, lease_ms: int, limit: int) -> list[str]:
        ids = await self._claim(keys=[self.keys.callback_due()], args=[now_ms, now_ms + lease_ms, limit])
        return [i.decode() if isinstance(i, bytes) else i for i in ids]

    async def defer(self, delivery_id: str, due_ms: int) -> None:
        """Give a claimed delivery back, due at `due_ms`, without an attempt (its state is untouched)."""
        await self.redis.zadd(self.keys.callback_due(), {delivery_id: due_ms}, xx=True)

    async def next_due_ms(self) -> int | None:
        first = await self.redis.zrange(self.keys.callback_due(), 0, 0, withscores=True)
        return int(first[0][1]) if first else None

    async def load(self, delivery_id: str) -> tuple[CallbackDelivery, CallbackState] | None:
        raw = await self.redis.hgetall(self.keys.callback_state(delivery_id))
        if b"delivery" not in raw or b"state" not in raw:
            return None
        return decode(raw[b"delivery"], CallbackDelivery), decode(raw[b"state"], CallbackState)

    async def record(self, state: CallbackState, next_due_ms: int | None, dead: bool = False) -> None:
        await self._result(
            keys=[self.keys.callback_state(state.delivery_id), self.keys.callback_due(), self.keys.callback_dead()],
            args=[encode(state), state.delivery_id, "" if next_due_ms is None else next_due_ms, "1" if dead else "0",
                  FINAL_TTL_MS])

    async def is_disabled(self, tenant: str, url: str) -> bool:
        return bool(await self.redis.sismember(self.keys.callback_disabled(tenant), url))

    async def disable(self, tenant: str, url: str) -> None:
        await self.redis.sadd(self.keys.callback_disabled(tenant), url)

    async def enable(self, tenant: str, url: str) -> bool:
        """Allow a URL its receiver disabled with 410 again (the operator's call); False if it was not disabled."""
        return bool(await self.redis.srem(self.keys.callback_disabled(tenant), url))

    async def disabled(self, tenant: str) -> list[str]:
        return sorted(u.decode() for u in await self.redis.smembers(self.keys.callback_disabled(tenant)))

    async def replay(self, delivery_id: str, now_ms: int) -> CallbackState | None:
        """Schedule a dead or failed delivery again, from attempt zero. None if there is nothing to replay."""
        loaded = await self.load(delivery_id)
        if loaded is None or loaded[1].status not in REPLAYABLE:
            return None
        delivery, _state = loaded
        fresh = CallbackState(delivery.delivery_id, delivery.event, delivery.url, "pending", next_attempt_ms=now_ms)
        await self.redis.persist(self.keys.callback_state(delivery_id))
        await self.record(fresh, now_ms)
        return fresh
