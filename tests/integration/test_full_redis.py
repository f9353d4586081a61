"""A Redis that is full (maxmemory reached, noeviction, as batchgate's Redis must run) refuses writes: a caller
gets 503 with Retry-After, as for a Redis it cannot reach, and nothing it sent is half-stored (it got a 500)."""

from __future__ import annotations

import shutil

import pytest
import redis

from shared.embedded_redis import start_embedded_redis
from tests.stack import make_settings, running_gateway

pytestmark = [pytest.mark.redis, pytest.mark.skipif(not shutil.which("redis-server"), reason="needs redis-server")]


async def test_a_full_redis_answers_503_with_retry_after(prefix):
    own = start_embedded_redis()  # a private redis-server: its memory limit is this test's alone
    try:
        assert own.kind == "redis-server", own
        client = redis.Redis.from_url(own.url)
        client.config_set("maxmemory-policy", "noeviction")
        for i in range(40):  # in small writes: a 2 MB one leaves a query buffer Redis frees later, under the limit
            client.set(f"{prefix}:ballast:{i}", b"x" * 50_000)
        client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) - 500_000))  # full already
        settings = make_settings(own.url, prefix)
        async with running_gateway(settings) as gw:
            r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x" * 5000}})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "unavailable" and int(r.headers["retry-after"]) >= 1
            o = await gw.client.post("/v1/embeddings", json={"model": "minilm", "input": "x" * 5000})
            assert o.status_code == 503 and o.json()["error"]["type"] == "service_unavailable_error"
        client.close()
    finally:
        own.stop()
