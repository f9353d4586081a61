"""What a Redis Cluster answers while it fails over (CLUSTERDOWN, MASTERDOWN, TRYAGAIN, a slot no node covers, each
raised by redis-py once its own retries are spent) is an outage like a refused connection: a worker retries it, a
caller gets a 503 with Retry-After. A worker's heartbeat let CLUSTERDOWN through and the worker exited mid-failover
(the fault suite's cluster failover, one run in two), leaving every accepted request unserved."""

from __future__ import annotations

import pytest
from redis.exceptions import ClusterDownError, MasterDownError, SlotNotCoveredError, TryAgainError

from gateway.api import ApiRequest
from gateway.routes import RouteSpec, dispatch
from gpu_worker.announce import RedisAnnouncer
from gpu_worker.redis_replies import queue_errors
from gpu_worker.work_queue import QueueUnavailable
from shared.keys import Keys
from shared.redis_io import tolerate_outage

FAILOVER_REPLIES = [
    ClusterDownError("CLUSTERDOWN The cluster is down"),
    MasterDownError("MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
    SlotNotCoveredError('Slot "8301" is not covered by the cluster.'),
]
IDS = ["clusterdown", "masterdown", "tryagain", "slot-not-covered"]


@pytest.mark.parametrize("exc", FAILOVER_REPLIES, ids=IDS)
async def test_a_failover_reply_is_an_outage_for_the_worker(exc: Exception) -> None:
    async with tolerate_outage():
        raise exc
    with pytest.raises(QueueUnavailable):
        async with queue_errors():
            raise exc


class FailingRedis:
    """Every command raises what a cluster answers mid-failover."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc
        self.calls = 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        async def command(*args: object, **kwargs: object) -> None:
            self.calls += 1
            raise self.exc
        return command


@pytest.mark.parametrize("exc", FAILOVER_REPLIES, ids=IDS)
async def test_a_heartbeat_during_a_failover_is_skipped_not_fatal(exc: Exception) -> None:
    redis = FailingRedis(exc)
    announcer = RedisAnnouncer(redis, Keys("bgtest"))  # type: ignore[arg-type]
    await announcer.heartbeat("w-a", {"at": 1.0})  # the next beat, 2 s later, tries again
    assert redis.calls == 1


@pytest.mark.parametrize("exc", FAILOVER_REPLIES, ids=IDS)
async def test_a_failover_reply_is_a_503_with_retry_after_for_a_caller(exc: Exception) -> None:
    async def handler(svc: object, req: ApiRequest) -> None:
        raise exc

    route = RouteSpec.make("POST", "/v1/models/{model}/requests", handler, public=True)
    resp = await dispatch(route, None, ApiRequest("POST", "/v1/models/m/requests"), [])  # type: ignore[arg-type]
    assert resp.status == 503 and resp.headers.get("Retry-After") == "1"
    assert resp.body["error"]["code"] == "unavailable"
