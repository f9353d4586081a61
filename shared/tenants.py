"""Tenants: API keys (stored hashed), webhook secrets, per-tenant limits. One Redis hash per tenant.

`bg:tenant:<name>` fields: `webhook_secrets` (JSON list, newest first: several during a rotation),
`thin_callbacks` ("1": webhooks carry ids only), `rate_per_s`, `burst`, `max_backlog`.
`bg:apikey:<sha256>` -> tenant name; `bg:tenant:<name>:keys` -> the set of that tenant's key hashes.
An API key is shown once, when created; only its SHA-256 is stored.
`bg:webhooks:default` -> a fingerprint (never the secret) of the default secret the dispatcher signs with for
tenants without one of their own, written by the dispatcher at start, absent when it has none: operations
tools run where that secret is not set must neither replace it for a tenant nor rotate it away.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.keys import Keys

KEY_PREFIX = "bgk_"


@dataclass(frozen=True, slots=True)
class TenantConfig:
    name: str
    webhook_secrets: tuple[str, ...] = ()
    thin_callbacks: bool = False
    rate_per_s: float | None = None
    burst: int | None = None
    max_backlog: int | None = None


def new_webhook_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def new_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_digest(key_or_hash: str) -> str:
    """The stored hash of an API key given as itself or as its hash (as `list_keys` shows it)."""
    return key_or_hash if len(key_or_hash) == 64 and not key_or_hash.startswith(KEY_PREFIX) else hash_key(key_or_hash)


MAX_TENANT_CHARS = 128


def tenant_name_problem(name: str) -> str | None:
    """Why `name` cannot name a tenant, or None. A name is part of Redis keys (`bg:tenant:<name>`, whose keys set is
    `bg:tenant:<name>:keys`) and of `keys list`'s `TENANT HASH` lines: not empty, no whitespace, control
    characters or ':'."""
    if not name:
        return "a tenant name must not be empty"
    if len(name) > MAX_TENANT_CHARS:  # it is in every key and metric label of the tenant's, and in its log lines
        return f"a tenant name must be at most {MAX_TENANT_CHARS} characters, got {len(name)}"
    if ":" in name or not name.isprintable() or any(c.isspace() for c in name):
        return f"tenant name {name!r} must have no spaces, control characters or ':'"
    return None


def secret_fingerprint(secret: str) -> str:
    return hashlib.sha256(b"batchgate-webhook-default:" + secret.encode("utf-8")).hexdigest()[:16]


class DefaultSecretUnknown(Exception):
    """The dispatcher signs this tenant's webhooks with a default secret this process does not hold."""


class TenantStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, default_webhook_secret: str = "", *,
                 check_default: bool = False) -> None:
        self.redis = redis
        self.keys = keys
        self.default_webhook_secret = default_webhook_secret
        # operations tools: a default secret of their own must be the one the dispatcher announced
        self.check_default = check_default

    async def get(self, tenant: str) -> TenantConfig:
        raw = {k.decode(): v.decode() for k, v in (await self.redis.hgetall(self.keys.tenant(tenant))).items()}
        return TenantConfig(
            name=tenant,
            webhook_secrets=tuple(json.loads(raw.get("webhook_secrets", "[]"))),
            thin_callbacks=raw.get("thin_callbacks") == "1",
            rate_per_s=float(raw["rate_per_s"]) if raw.get("rate_per_s") else None,
            burst=int(raw["burst"]) if raw.get("burst") else None,
            max_backlog=int(raw["max_backlog"]) if raw.get("max_backlog") else None,
        )

    async def set(self, tenant: str, **fields: str | float | int | bool | None) -> None:
        mapping = {}
        for name, value in fields.items():
            if value is None:
                await self.redis.hdel(self.keys.tenant(tenant), name)
            elif isinstance(value, bool):
                mapping[name] = "1" if value else "0"
            else:
                mapping[name] = str(value)
        if mapping:
            await self.redis.hset(self.keys.tenant(tenant), mapping=mapping)

    async def announce_default_secret(self) -> None:
        """The dispatcher, at start: whether (and which, as a fingerprint) a default secret signs for tenants
        without one of their own."""
        if self.default_webhook_secret:
            await self.redis.set(self.keys.webhook_default(), secret_fingerprint(self.default_webhook_secret))
        else:
            await self.redis.delete(self.keys.webhook_default())

    async def _check_default(self, tenant: str) -> None:
        """Refuse to act for a tenant that signs with the dispatcher's default secret unless this process holds
        that same secret: it would otherwise create or rotate in a secret that receivers do not hold."""
        announced = await self.redis.get(self.keys.webhook_default())
        if announced is None:
            return
        if not self.default_webhook_secret:
            raise DefaultSecretUnknown(
                f"tenant {tenant} has no webhook secret of its own: the dispatcher signs its webhooks with the "
                "default secret (BATCHGATE_WEBHOOK_SECRET), which is not set here; set it to the dispatcher's "
                "value and run this again")
        if announced.decode() != secret_fingerprint(self.default_webhook_secret):
            raise DefaultSecretUnknown(
                f"tenant {tenant} signs with the dispatcher's default secret, and BATCHGATE_WEBHOOK_SECRET here "
                "is a different one; set it to the dispatcher's value and run this again")

    async def webhook_secrets(self, tenant: str) -> tuple[str, ...]:
        """The secrets to sign with; creates one for a tenant that has none (and no default is set)."""
        cfg = await self.get(tenant)
        if cfg.webhook_secrets:
            return cfg.webhook_secrets
        if self.default_webhook_secret:
            if self.check_default:
                await self._check_default(tenant)
            return (self.default_webhook_secret,)
        await self._check_default(tenant)
        secret = new_webhook_secret()
        created = await self.redis.hsetnx(self.keys.tenant(tenant), "webhook_secrets", json.dumps([secret]))
        return (secret,) if created else (await self.get(tenant)).webhook_secrets

    async def rotate_webhook_secret(self, tenant: str, keep_previous: bool = True) -> str:
        """A new secret, signed with alongside the previous one until `drop_old_webhook_secrets`."""
        # the secret signed with until now: the tenant's own, or the default (BATCHGATE_WEBHOOK_SECRET) that a
        # tenant without one of its own signs with; either way receivers hold it, so it is kept
        current = (await self.get(tenant)).webhook_secrets
        if not current:
            await self._check_default(tenant)
            current = (self.default_webhook_secret,) if self.default_webhook_secret else ()
        secret = new_webhook_secret()
        kept = list(current[:1]) if keep_previous else []
        await self.redis.hset(self.keys.tenant(tenant), "webhook_secrets", json.dumps([secret, *kept]))
        return secret

    async def drop_old_webhook_secrets(self, tenant: str) -> None:
        current = (await self.get(tenant)).webhook_secrets
        await self.redis.hset(self.keys.tenant(tenant), "webhook_secrets", json.dumps(list(current[:1])))

    # --- API keys --------------------------------------------------------------------------------
    async def create_key(self, tenant: str) -> str:
        key = new_api_key()
        digest = hash_key(key)
        # listed first, then valid: the two keys may be on different Redis Cluster nodes, so no transaction; a
        # create cut in between leaves a listed key that does not work, never a working key no one can see
        await self.redis.sadd(self.keys.tenant_keys(tenant), digest)
        await self.redis.set(self.keys.api_key(digest), tenant)
        return key

    async def revoke_key(self, key_or_hash: str) -> str | None:
        """Revoke by the key itself or its hash (as `list_keys` shows); returns the tenant it belonged to."""
        digest = key_digest(key_or_hash)
        tenant = await self.redis.get(self.keys.api_key(digest))
        if tenant is None:
            return None
        # invalid first, then unlisted (as `create_key`, the other way round)
        await self.redis.delete(self.keys.api_key(digest))
        await self.redis.srem(self.keys.tenant_keys(tenant.decode()), digest)
        return tenant.decode()

    async def tenant_of(self, key: str) -> str | None:
        tenant = await self.redis.get(self.keys.api_key(hash_key(key)))
        return tenant.decode() if tenant is not None else None

    async def list_keys(self, tenant: str) -> list[str]:
        return sorted(d.decode() for d in await self.redis.smembers(self.keys.tenant_keys(tenant)))
