"""Who is calling: API keys -> tenant. The per-tenant limits at submit are `shared.tenant_limits`.

- A key arrives as `Authorization: Bearer <key>` or `X-API-Key: <key>`; only its SHA-256 is stored.
  Lookups are cached for `KEY_CACHE_S` per process (so a revoked key stops working within that).
- Every 401 carries `WWW-Authenticate: Bearer` (RFC 6750), with `error="invalid_token"` when a key was given
  and is not valid. Another `Authorization` scheme (Basic, Digest, ...) is `unsupported_auth_scheme`, not a
  missing key: the caller sent credentials, of a kind batchgate does not take.
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
HOW = "Authorization: Bearer <key> or X-API-Key: <key>"
# the Authorization schemes an error names back (IANA's registry and common others); anything else may be a key
KNOWN_SCHEMES = frozenset({"basic", "digest", "negotiate", "ntlm", "hoba", "mutual", "vapid", "scram-sha-1",
                           "scram-sha-256", "token", "dpop", "gnap", "privatetoken", "concealed", "aws4-hmac-sha256",
                           "apikey", "api-key", "key", "oauth"})
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="batchgate"'}
INVALID_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="batchgate", error="invalid_token"'}


class ConflictingKeys(ValueError):
    """A Bearer key and a different X-API-Key on one request."""


class UnsupportedScheme(ValueError):
    """An `Authorization` header of a scheme other than Bearer (and no `X-API-Key`)."""

    def __init__(self, scheme: str) -> None:
        super().__init__(scheme)
        self.scheme = scheme


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
        try:
            key = _key_from(req)
        except ConflictingKeys:
            raise Unauthorized("two different API keys (Authorization: Bearer and X-API-Key): send one",
                               code="conflicting_api_keys", headers=CHALLENGE) from None
        except UnsupportedScheme as exc:
            # a scheme named only when it is one (a key sent without `Bearer ` would otherwise come back in the
            # body, and with it into the logs of every client and proxy on the way)
            what = (f"the Authorization scheme {exc.scheme!r} is not supported" if exc.scheme.lower() in KNOWN_SCHEMES
                    else "the Authorization header is not `Bearer <key>`")
            raise Unauthorized(f"{what}: send the API key as {HOW}",
                               code="unsupported_auth_scheme", headers=CHALLENGE) from None
        if not key:
            raise Unauthorized(f"an API key is required ({HOW})", code="missing_api_key", headers=CHALLENGE)
        if not key.isprintable() or len(key) > 512:  # not a key we could have issued (nor valid text to hash)
            raise Unauthorized("invalid or revoked API key", code="invalid_api_key", headers=INVALID_CHALLENGE)
        tenant = await self._cache.get("key:" + key, lambda: self.tenants.tenant_of(key))
        if not isinstance(tenant, str):
            raise Unauthorized("invalid or revoked API key", code="invalid_api_key", headers=INVALID_CHALLENGE)
        return tenant

    async def config(self, tenant: str) -> TenantConfig:
        return await self.limits.config(tenant)

    async def admit(self, tenant: str, request_id: str = "", expires_ms: int = 0, *, tokens: int = 1) -> bool:
        return await self.limits.admit(tenant, request_id, expires_ms, tokens=tokens)

    async def release(self, tenant: str, request_id: str) -> None:
        await self.limits.release(tenant, request_id)


def _key_from(req: ApiRequest) -> str | None:
    """The API key a request carries; `UnsupportedScheme` for credentials of another scheme and no X-API-Key."""
    auth = (req.header("authorization") or "").strip()
    scheme, _, rest = auth.partition(" ")
    key = (req.header("x-api-key") or "").strip() or None
    if scheme.lower() == "bearer":
        bearer = rest.strip() or None
        if key is not None and bearer is not None and key != bearer:  # which one the caller meant is not known
            raise ConflictingKeys
        return bearer or key  # an empty `Bearer` beside an X-API-Key: the key
    if key is None and auth:
        raise UnsupportedScheme(scheme[:32])
    return key
