"""Fixtures shared by every tier: the real Redis, key prefixes that isolate each test, and loaded models."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

TEST_REDIS_URL = os.environ.get("BATCHGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis. Not reachable is a failure, not a skip: `.ci/run` starts one."""
    client = redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"tests need a real Redis at {TEST_REDIS_URL} (start one: see README): {exc}")
    finally:
        client.close()
    return TEST_REDIS_URL


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards (and nothing else)."""
    value = f"bgtest-{secrets.token_hex(4)}"
    yield value
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{value}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = os.environ.get("BATCHGATE_MODEL_CACHE")
    return Path(shared) if shared else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def loaded_models(model_cache: Path) -> dict[str, object]:
    """minilm and tiny-llama, loaded once per session through the same path a worker uses."""
    from gpu_worker import models
    from shared.config import BUILTIN_MODELS

    return {name: models.load(BUILTIN_MODELS[name], model_cache) for name in ("minilm", "tiny-llama")}


@pytest.fixture
async def aioredis_client(redis_url: str) -> AsyncIterator[object]:
    from shared.redis_io import make_redis

    client = make_redis(redis_url)
    yield client
    await client.aclose()
