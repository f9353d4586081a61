"""Who is calling: API keys -> tenant. The per-tenant limits at submit are `shared.tenant_limits`.

- A key arrives as `Authorization: Bearer <key>` or `X-API-Key: <key>`; only its SHA-256 is stored.
  Lookups are cached for `KEY_CACHE_S` per process (so a revoked key stops working within that).
- With `BATCHGATE_AUTH=off` (the `batchgate up` default, and logged loudly) every caller is tenant
  `default`.
"""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog

from gateway.api import ApiRequest, Unauthorized
from shared.keys import Keys
from shared.tenant_limits import CACHE_S, TenantLimits
from shared.tenants import TenantConfig, TenantStore

log = structlog.get_logger(__name__)

KEY_CACHE_S = CACHE_S
DEFAULT_TENANT = "default"


class Auth:
    """API keys, plus the tenant limits (one lookup cache for both: `_cache.clear()` forgets them all)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, mode: str, limits: TenantLimits) -> None:
        self.redis = redis
        self.keys = keys
        self.mode = mode
        self.tenants = TenantStore(redis, keys)
        self.limits = limits
        self._cache = limits.cache

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
        if not key.isprintable() or len(key) > 512:  # not a key we could have issued (nor valid text to hash)
            raise Unauthorized("invalid or revoked API key", code="invalid_api_key")
        tenant = await self._cache.get("key:" + key, lambda: self.tenants.tenant_of(key))
        if not isinstance(tenant, str):
            raise Unauthorized("invalid or revoked API key", code="invalid_api_key")
        return tenant

    async def config(self, tenant: str) -> TenantConfig:
        return await self.limits.config(tenant)

    async def admit(self, tenant: str, request_id: str = "", expires_ms: int = 0) -> bool:
        return await self.limits.admit(tenant, request_id, expires_ms)

    async def release(self, tenant: str, request_id: str) -> None:
        await self.limits.release(tenant, request_id)


def _key_from(req: ApiRequest) -> str | None:
    auth = req.header("authorization") or ""
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return (req.header("x-api-key") or "").strip() or None
