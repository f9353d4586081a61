"""Idempotency keys: what a key maps to (the request it created, a hash of the body that created it),
claimed atomically in Redis so that one key never creates two requests.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import msgpack
import redis.asyncio as aioredis

from shared.keys import Keys

CAS_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""

RELEASE_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


@dataclass(frozen=True, slots=True)
class IdempotencyClaim:
    """What an `Idempotency-Key` maps to: the request it created and a hash of the body that created it."""

    request_id: str
    body_hash: str
    at_ms: int

    def encode(self) -> bytes:
        return msgpack.packb([self.request_id, self.body_hash, self.at_ms])

    @classmethod
    def decode(cls, raw: bytes) -> IdempotencyClaim:
        rid, body_hash, at_ms = msgpack.unpackb(raw)
        return cls(rid, body_hash, int(at_ms))


def body_hash(model: str, body: Any, call: str = "") -> str:
    """What makes two submits "the same request": everything but their deadline, which a retry from a
    Lambda recomputes (and so would turn every retry into a conflict). `call`: what else the call that submits it
    says about it (an OpenAI call's number of choices), so a retry that changes that is a conflict too."""
    same = {k: v for k, v in body.items() if k not in ("timeout_s", "deadline")} if isinstance(body, dict) else body
    text = model + "\0" + json.dumps(same, sort_keys=True, separators=(",", ":")) + ("\0" + call if call else "")
    return hashlib.sha256(text.encode()).hexdigest()


class IdempotencyStore:
    def __init__(self, redis: aioredis.Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_ms = ttl_s * 1000
        self._cas = redis.register_script(CAS_LUA)
        self._release = redis.register_script(RELEASE_LUA)

    async def get(self, tenant: str, key: str) -> IdempotencyClaim | None:
        raw = await self.redis.get(self.keys.idempotency(tenant, key))
        return IdempotencyClaim.decode(raw) if raw else None

    async def claim(self, tenant: str, key: str, claim: IdempotencyClaim) -> IdempotencyClaim | None:
        """Claim the key for `claim` (atomically: SET NX). None if claimed, else the existing claim."""
        if await self.redis.set(self.keys.idempotency(tenant, key), claim.encode(), px=self.ttl_ms, nx=True):
            return None
        return await self.get(tenant, key)

    async def takeover(self, tenant: str, key: str, old: IdempotencyClaim, new: IdempotencyClaim) -> bool:
        """Replace `old` with `new` only if the key still holds `old` (compare-and-set)."""
        return bool(await self._cas(keys=[self.keys.idempotency(tenant, key)],
                                    args=[old.encode(), new.encode(), self.ttl_ms]))

    async def release(self, tenant: str, key: str, claim: IdempotencyClaim) -> bool:
        """Give the key back, only if it still holds `claim` (its request was never stored): a retry with
        the key then submits afresh instead of finding a claim that maps to nothing."""
        return bool(await self._release(keys=[self.keys.idempotency(tenant, key)], args=[claim.encode()]))
