"""Per-tenant limits at submit: a rate limit and a backlog quota, both in Redis, one Lua call each.

- Rate limit: a token bucket per tenant (`rate_per_s`, `burst`).
- Backlog quota: each tenant's requests that are queued or running, in a sorted set scored by
  deadline (workers remove finished ones; ones past their deadline drop out by themselves).
A tenant's own settings (`shared.tenants`) override the deployment's defaults; lookups are cached for
`CACHE_S` per process. Used by the HTTP gateway and the SDK's direct mode alike.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.api_errors import TooManyRequests
from shared.keys import Keys
from shared.tenants import TenantConfig, TenantStore

CACHE_S = 5.0
ACTIVE_SET_TTL_MS = 2 * 3600 * 1000

# KEYS bucket; ARGV rate/s, burst, now_ms, n. Returns 0 if taken, else ms until n tokens are there.
BUCKET_LUA = """
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local n = tonumber(ARGV[4])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(b[1]) or burst
local at = tonumber(b[2]) or now
tokens = math.min(burst, tokens + (now - at) * rate / 1000)
local wait = 0
if tokens >= n then tokens = tokens - n else wait = math.ceil((n - tokens) * 1000 / rate) end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'at', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst * 1000 / rate) + 1000)
return wait
"""

# KEYS active set; ARGV now_ms, quota, request id, expires_ms, ttl_ms. Drops entries past their deadline,
# then reserves a slot for the request if one is free (check and reserve in one step: no race).
QUOTA_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


@dataclass
class _Cached:
    value: object
    until: float


class LookupCache:
    """Redis lookups kept for `CACHE_S` per process (so a change takes effect within that)."""

    def __init__(self, ttl_s: float = CACHE_S, max_entries: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: dict[str, _Cached] = {}

    def clear(self) -> None:
        self._entries.clear()

    async def get(self, name: str, load: Callable[[], Awaitable[object]]) -> object:
        now = time.monotonic()
        hit = self._entries.get(name)
        if hit is not None and hit.until > now:
            return hit.value
        value = await load()
        if len(self._entries) > self.max_entries:
            self._entries.clear()
        self._entries[name] = _Cached(value, now + self.ttl_s)
        return value


class TenantLimits:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, default_rate_per_s: float, default_burst: int,
                 default_max_backlog: int, clock: Callable[[], float] = time.time,
                 cache: LookupCache | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.tenants = TenantStore(redis, keys)
        self.default_rate = default_rate_per_s
        self.default_burst = default_burst
        self.default_backlog = default_max_backlog
        self.clock = clock
        self.cache = cache or LookupCache()
        self._bucket = redis.register_script(BUCKET_LUA)
        self._quota = redis.register_script(QUOTA_LUA)

    async def config(self, tenant: str) -> TenantConfig:
        cfg = await self.cache.get("cfg:" + tenant, lambda: self.tenants.get(tenant))
        return cfg if isinstance(cfg, TenantConfig) else TenantConfig(tenant)

    async def max_backlog(self, tenant: str) -> int | None:
        """The most requests the tenant may have queued or running at once; None: no quota."""
        return self._quota_of(await self.config(tenant))

    def _quota_of(self, cfg: TenantConfig) -> int | None:
        quota = cfg.max_backlog if cfg.max_backlog is not None else self.default_backlog
        return quota if quota and quota > 0 else None

    async def admit(self, tenant: str, request_id: str = "", expires_ms: int = 0, *, tokens: int = 1) -> bool:
        """Raise 429 with Retry-After if the tenant is over its rate or its backlog quota; otherwise take `tokens`
        rate tokens (a call of several requests takes them all with its first, 0 with the others) and (with a
        quota) reserve the request's slot until it finishes or `expires_ms`. True when a slot was reserved (then
        whoever ends the request gives it back)."""
        cfg = await self.config(tenant)
        rate = cfg.rate_per_s if cfg.rate_per_s is not None else self.default_rate
        if rate and rate > 0 and tokens > 0:
            burst = cfg.burst if cfg.burst is not None else (self.default_burst or max(1, math.ceil(rate)))
            wait_ms = await self._bucket(keys=[self.keys.rate(tenant, 0)],
                                         args=[rate, max(burst, tokens), int(self.clock() * 1000), tokens])
            if int(wait_ms) > 0:
                raise TooManyRequests(f"tenant {tenant!r} is over its rate limit of {rate:g} requests/s",
                                      code="rate_limited", retry_after=int(wait_ms) / 1000)
        quota = self._quota_of(cfg)
        if quota is not None:
            fits = await self._quota(keys=[self.keys.tenant_active(tenant)],
                                     args=[int(self.clock() * 1000), quota, request_id, expires_ms, ACTIVE_SET_TTL_MS])
            if not int(fits):
                raise TooManyRequests(f"tenant {tenant!r} has {quota} requests queued or running, its quota",
                                      code="tenant_backlog_full", retry_after=1)
            return True
        return False

    async def release(self, tenant: str, request_id: str) -> None:
        """Give back a reserved slot (the request was refused after all)."""
        await self.redis.zrem(self.keys.tenant_active(tenant), request_id)
