"""A streaming request's delta stream lives as long as its record can: a caller resuming with Last-Event-ID
while the record is there finds its deltas there too (else it would be sent the whole output again)."""

from __future__ import annotations

import pytest

from gpu_worker.redis_queue import RedisQueue
from shared.keys import Keys
from shared.messages import StreamDelta
from shared.records import RecordStore
from shared.redis_io import make_redis

pytestmark = pytest.mark.redis
RESULT_TTL_S = 60


@pytest.fixture
async def parts(redis_url, prefix):
    client = make_redis(redis_url)
    keys = Keys(prefix)
    yield client, keys, RedisQueue(client, keys, RecordStore(client, keys, RESULT_TTL_S), expiry_grace_s=2.0)
    await client.aclose()


async def test_the_deltas_outlive_a_record_that_lives_to_a_far_deadline(parts):
    client, keys, queue = parts
    await client.hset(keys.record("far"), "state", "running")
    await client.pexpire(keys.record("far"), 3_600_000)  # a deadline an hour away, plus the result TTL
    await queue.publish_deltas([("far", StreamDelta(0, (5, 6), "ab"), True)])
    await queue.publish_deltas([("far", StreamDelta(2, (7,), "c"), False)])  # a later delta leaves the TTL alone
    left = await client.pttl(keys.events("far"))
    assert 3_600_000 + 12_000 - 5_000 < left <= 3_600_000 + 12_000  # the record's, plus the grace and the slack


async def test_without_a_record_the_deltas_keep_the_result_ttl(parts):
    client, keys, queue = parts
    await client.hset(keys.record("near"), "state", "running")
    await client.pexpire(keys.record("near"), 1_000)  # a record about to go: never shorter than a result's life
    await queue.publish_deltas([("near", StreamDelta(0, (5,), "a"), True), ("none", StreamDelta(0, (1,), "x"), True)])
    for rid in ("near", "none"):
        assert RESULT_TTL_S * 1000 - 5_000 < await client.pttl(keys.events(rid)) <= RESULT_TTL_S * 1000


async def test_a_later_delta_that_finds_no_stream_gives_the_one_it_makes_a_ttl(parts):
    """A Redis restarted without persistence loses the stream while its worker runs on: the stream the next delta
    makes expires as a first delta's would (it lived forever)."""
    client, keys, queue = parts
    await queue.publish_deltas([("lost", StreamDelta(7, (5,), "a"), False)])
    assert RESULT_TTL_S * 1000 - 5_000 < await client.pttl(keys.events("lost")) <= RESULT_TTL_S * 1000
