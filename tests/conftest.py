"""Fixtures shared by every tier: the real Redis, key prefixes that isolate each test, and loaded models."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import hypothesis
import pytest
import redis

from tests.redis_cluster import delete_prefix, start_cluster, sync_client
from tests.torch_guard import (  # noqa: F401  (the fast tier's torch guard: every test under tests/)
    pytest_collectreport,
    pytest_runtest_logfinish,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# property tests check what is computed, never how fast: Hypothesis's 200 ms per example failed one on a loaded machine
hypothesis.settings.register_profile("batchgate", deadline=None)
hypothesis.settings.load_profile("batchgate")

TEST_REDIS_URL = os.environ.get("BATCHGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
# "cluster": the suites that use `redis_url` run against a Redis Cluster of 3 masters and 3 replicas on loopback,
# started for the session (`tests/redis_cluster.py`); CI runs the Redis tiers both ways.
TEST_REDIS = os.environ.get("BATCHGATE_TEST_REDIS", "single")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The real Redis (or Redis Cluster). Not reachable is a failure, not a skip: `.ci/run` starts one."""
    if TEST_REDIS == "cluster":
        cluster = start_cluster()
        yield cluster.url
        cluster.stop()
        return
    client = redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"tests need a real Redis at {TEST_REDIS_URL} (start one: see README): {exc}")
    finally:
        client.close()
    yield TEST_REDIS_URL


@pytest.fixture
def sync_redis(redis_url: str) -> Iterator[redis.Redis]:
    """A blocking client of the test Redis (a cluster client when the suites run on a cluster)."""
    client = sync_client(redis_url)
    yield client
    client.close()


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """A key prefix of this test's own; every key under it is deleted afterwards (and nothing else)."""
    value = f"bgtest-{secrets.token_hex(4)}"
    yield value
    delete_prefix(redis_url, value)


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
