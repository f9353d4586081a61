"""Who is calling, and may they submit now: API keys -> tenant, per-tenant rate limit and backlog quota.

- A key arrives as `Authorization: Bearer <key>` or `X-API-Key: <key>`; only its SHA-256 is stored.
  Lookups are cached for `KEY_CACHE_S` per process (so a revoked key stops working within that).
- With `BATCHGATE_AUTH=off` (the `batchgate up` default, and logged loudly) every caller is tenant
  `default`.
- Rate limit: a token bucket per tenant in Redis (`rate_per_s`, `burst`), one Lua call per submit.
- Backlog quota: each tenant's requests that are queued or running, in a sorted set scored by
  deadline (workers remove finished ones; ones past their deadline drop out by themselves).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
import structlog

from gateway.api import ApiRequest, TooManyRequests, Unauthorized
from shared.keys import Keys
from shared.tenants import TenantConfig, TenantStore

log = structlog.get_logger(__name__)

KEY_CACHE_S = 5.0
ACTIVE_SET_TTL_MS = 2 * 3600 * 1000
DEFAULT_TENANT = "default"

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
    value: str | TenantConfig | None
    until: float


class Auth:
    def __init__(self, redis: aioredis.Redis, keys: Keys, *, mode: str, default_rate_per_s: float,
                 default_burst: int, default_max_backlog: int, clock: Callable[[], float] = time.time) -> None:
        self.redis = redis
        self.keys = keys
        self.mode = mode
        self.tenants = TenantStore(redis, keys)
        self.default_rate = default_rate_per_s
        self.default_burst = default_burst
        self.default_backlog = default_max_backlog
        self.clock = clock
        self._cache: dict[str, _Cached] = {}
        self._bucket = redis.register_script(BUCKET_LUA)
        self._quota = redis.register_script(QUOTA_LUA)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    async def tenant_for(self, req: ApiRequest) -> str:
        if not self.enabled:
            return DEFAULT_TENANT
        key = _key_from(req)
        if not key:
            raise Unauthorized("an API key is required (Authorization: Bearer <key> or X-API-Key)",
                               code="missing_api_key")
        tenant = await self._cached("key:" + key, lambda: self.tenants.tenant_of(key))
        if not isinstance(tenant, str):
            raise Unauthorized("invalid or revoked API key", code="invalid_api_key")
        return tenant

    async def config(self, tenant: str) -> TenantConfig:
        cfg = await self._cached("cfg:" + tenant, lambda: self.tenants.get(tenant))
        return cfg if isinstance(cfg, TenantConfig) else TenantConfig(tenant)

    async def _cached(self, name: str, load: Callable[[], object]) -> object:
        now = time.monotonic()
        hit = self._cache.get(name)
        if hit is not None and hit.until > now:
            return hit.value
        value = await load()  # type: ignore[misc]
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[name] = _Cached(value, now + KEY_CACHE_S)
        return value

    async def admit(self, tenant: str, request_id: str = "", expires_ms: int = 0) -> None:
        """Raise 429 with Retry-After if the tenant is over its rate or its backlog quota; otherwise take a
        rate token and (with a quota) reserve the request's slot until it finishes or `expires_ms`."""
        n = 1
        cfg = await self.config(tenant)
        rate = cfg.rate_per_s if cfg.rate_per_s is not None else self.default_rate
        if rate and rate > 0:
            burst = cfg.burst if cfg.burst is not None else (self.default_burst or max(1, math.ceil(rate)))
            wait_ms = await self._bucket(keys=[self.keys.rate(tenant, 0)],
                                         args=[rate, max(burst, n), int(self.clock() * 1000), n])
            if int(wait_ms) > 0:
                raise TooManyRequests(f"tenant {tenant!r} is over its rate limit of {rate:g} requests/s",
                                      code="rate_limited", retry_after=int(wait_ms) / 1000)
        quota = cfg.max_backlog if cfg.max_backlog is not None else self.default_backlog
        if quota and quota > 0:
            fits = await self._quota(keys=[self.keys.tenant_active(tenant)],
                                     args=[int(self.clock() * 1000), quota, request_id, expires_ms, ACTIVE_SET_TTL_MS])
            if not int(fits):
                raise TooManyRequests(f"tenant {tenant!r} has {quota} requests queued or running, its quota",
                                      code="tenant_backlog_full", retry_after=1)

    async def release(self, tenant: str, request_id: str) -> None:
        """Give back a reserved slot (the request was refused after all)."""
        await self.redis.zrem(self.keys.tenant_active(tenant), request_id)


def _key_from(req: ApiRequest) -> str | None:
    auth = req.header("authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return (req.header("x-api-key") or "").strip() or None
