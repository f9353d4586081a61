"""Durable writes (`BATCHGATE_REDIS_WAIT_REPLICAS`): a submit is answered 202, and a result counts as written,
only once that many replicas have it. Against a Redis without replicas, nothing can be: the submit answers
503 (retryable, with Retry-After) instead of a 202 a failover could take back, and a result write raises, so
the worker keeps its entry unacknowledged. The failover fault scenario shows the positive side on a cluster."""

from __future__ import annotations

import time

import pytest

from gpu_worker.outcomes import result_for
from shared.keys import Keys
from shared.records import RecordStore
from shared.redis_io import NotReplicated, make_redis
from shared.states import FinishReason, Status
from tests.fakes import make_request
from tests.stack import make_settings, running_gateway

pytestmark = pytest.mark.redis


async def replicas(redis_url: str) -> int:
    client = make_redis(redis_url)
    try:
        info = await client.info("replication")
        if "role" in info:  # a single Redis
            return int(info.get("connected_slaves", 0))
        return min(int(v.get("connected_slaves", 0)) for v in info.values() if v.get("role") == "master")
    finally:
        await client.aclose()


async def test_a_submit_no_replica_confirmed_is_refused_with_503(redis_url, prefix):
    wanted = await replicas(redis_url) + 1  # more than this Redis has
    settings = make_settings(redis_url, prefix, redis_wait_replicas=wanted, redis_wait_ms=50,
                             callback_allow="127.0.0.0/8")
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/tiny-llama/requests",
                                 json={"input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 2},
                                       "callback": {"url": "http://127.0.0.1:9/hook"}})
        assert r.status_code == 503 and r.headers.get("retry-after"), r.text
        # it says why (not "unreachable"), and /readyz says the gateway cannot take submits
        assert r.json()["error"]["code"] == "not_replicated" and "BATCHGATE_REDIS_WAIT_REPLICAS" in r.text
        ready = await gw.client.get("/readyz")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_replicated", ready.text
        # the write reached the master: the request is ended there, so no worker computes what the caller was told
        # was refused (and a retry makes one request, not two)
        records = [k async for k in gw.service.redis.scan_iter(match=f"{prefix}:*") if b"req_" in k
                   and await gw.service.redis.type(k) == b"hash"]
        assert records, "the refused submit's record"
        for key in records:
            assert await gw.service.redis.hget(key, "state") == b"cancelled", key
            # and its webhook is never sent: it was never accepted (nothing in its outbox)
            assert not [f for f in await gw.service.redis.hkeys(key) if f.startswith(b"ob:")], key
    ok = make_settings(redis_url, prefix, redis_wait_replicas=wanted - 1, redis_wait_ms=50)
    async with running_gateway(ok) as gw:  # as many as it has: accepted
        r = await gw.client.post("/v1/models/tiny-llama/requests",
                                 json={"input": {"input_ids": [5, 6, 7]}, "params": {"max_new_tokens": 2}})
        assert r.status_code == 202, r.text
        if wanted - 1 > 0:
            assert (await gw.client.get("/readyz")).status_code == 200


async def test_a_result_no_replica_confirmed_is_not_counted_as_written(redis_url, prefix):
    client = make_redis(redis_url)
    try:
        store = RecordStore(client, Keys(prefix), 60, wait_replicas=await replicas(redis_url) + 1, wait_ms=50)
        req = make_request("req_durable")
        with pytest.raises(NotReplicated):
            await store.finish(result_for(req, Status.SUCCEEDED, worker="w", now=time.time(),
                                          reason=FinishReason.LENGTH), req.meta())
    finally:
        await client.aclose()
