"""The gateway's Redis side: `shared.queue_client.QueueClient` (admit, enqueue, read, wait on and cancel
requests; the SDK's direct mode uses the same) plus who is calling (`gateway.auth`). No HTTP here."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway import metrics
from gateway.auth import Auth
from shared.config import Settings
from shared.idempotency import IdempotencyClaim
from shared.queue_client import QueueClient, Submitted

__all__ = ["GatewayService", "IdempotencyClaim", "Submitted"]


class GatewayService(QueueClient):
    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(settings, redis=redis, clock=clock, observer=metrics.Counted())
        self.auth = Auth(self.redis, self.keys, mode=settings.auth, limits=self.limits)
