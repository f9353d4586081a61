"""The Python SDK (sync, async, direct-to-Redis) against the running stack; tenants and API keys."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from shared.config import BUILTIN_MODELS
from shared.keys import Keys
from shared.lanes import LaneSpec
from shared.sdk import (
    AsyncBatchgateClient,
    AuthError,
    BatchgateClient,
    DeadlineInfeasible,
    InvalidRequest,
    NotFound,
    OverCapacity,
    RequestFailed,
    Result,
    Submission,
)
from shared.tenants import TenantStore
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]


class Ctx:
    def __init__(self, ms: int) -> None:
        self.ms = ms

    def get_remaining_time_in_millis(self) -> int:
        return self.ms


async def keys_for(gw, *tenants: str) -> list[str]:
    store = TenantStore(gw.service.redis, Keys(gw.service.settings.key_prefix))
    return [await store.create_key(t) for t in tenants]


async def test_async_sdk_submit_wait_result_cancel_batch_stream(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, auth="api_key")
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        (key,) = await keys_for(gw, "acme")
        async with AsyncBatchgateClient(gw.base_url, api_key=key) as c:
            sub = await c.submit("minilm", {"text": "hello"})
            assert isinstance(sub, Submission) and sub.status == "queued"
            res = await c.result(sub.id, timeout=20)
            assert len(res.output["embeddings"][0]) == 384
            done = await c.submit("tiny-llama", {"prompt": "hi"}, params={"max_new_tokens": 4}, wait=20)
            assert isinstance(done, Result) and done.status == "succeeded"
            long = await c.submit("tiny-llama", {"input_ids": list(range(3, 300))},
                                  params={"max_new_tokens": 256, "ignore_eos": True})
            cancelled = await c.cancel(long.id)
            assert cancelled.status == "cancelled"
            with pytest.raises(RequestFailed) as failed:
                await c.result(long.id)
            assert failed.value.result.status == "cancelled"
            many = await c.submit_many("minilm", [{"input": {"text": f"t{i}"}} for i in range(5)]
                                       + [{"input": {"texts": []}}])
            assert [type(m).__name__ for m in many] == ["Submission"] * 5 + ["InvalidRequest"]
            for bad in ([{"text": "a"}], ["a"]):  # not a submit body: a typed error naming the item, nothing sent
                with pytest.raises(InvalidRequest,
                                   match=r"items\[0\]: .*'input' \(\{'input': \.\.\., 'params': \.\.\.\}\), got "):
                    await c.submit_many("minilm", bad)
            got = [r async for r in c.stream([m.id for m in many[:5]], timeout=30)]
            assert sorted(r.id for r in got) == sorted(m.id for m in many[:5])
            assert all(r.status == "succeeded" for r in got)


async def test_sync_sdk_and_typed_errors(redis_url, prefix, loaded_models):
    spec = dataclasses.replace(BUILTIN_MODELS["minilm"], lanes=(LaneSpec("all", None, 5.0, max_backlog=2),))
    settings = make_settings(redis_url, prefix, auth="api_key", models=(spec, BUILTIN_MODELS["tiny-llama"]))
    async with running_gateway(settings) as gw:
        (key,) = await keys_for(gw, "acme")

        def scenario() -> None:
            with BatchgateClient(gw.base_url, api_key=key) as c:
                with pytest.raises(NotFound):
                    c.get("req_" + "a" * 26)  # gone is NotFound too
                with pytest.raises(NotFound):
                    c.submit("no-such-model", {"text": "x"})
                with pytest.raises(InvalidRequest) as bad:
                    c.submit("minilm", {"texts": [1]})
                assert bad.value.status == 422
                c.submit("minilm", {"text": "1"})
                c.submit("minilm", {"text": "2"})
                with pytest.raises(OverCapacity) as full:  # no worker: the lane's backlog cap of 2 is reached
                    c.submit("minilm", {"text": "3"})
                assert full.value.retry_after is not None and full.value.retry_after >= 1
            with BatchgateClient(gw.base_url, api_key="bgk_nope") as c, pytest.raises(AuthError):
                c.get("req_" + "a" * 26)
            with BatchgateClient(gw.base_url, api_key=key, lambda_context=Ctx(300)) as c, \
                    pytest.raises(DeadlineInfeasible):  # 300 ms left, 500 ms margin: nothing is sent
                c.submit("tiny-llama", {"prompt": "x"})
            with BatchgateClient(gw.base_url, api_key=key, lambda_context=Ctx(8000)) as c:
                sub = c.submit("tiny-llama", {"prompt": "x"})
                assert sub.raw["deadline"] - __import__("time").time() < 8  # from the Lambda's remaining time

        await asyncio.to_thread(scenario)


async def test_direct_to_redis_client(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix)
    async with running_worker(settings, loaded_models), \
            AsyncBatchgateClient.direct(redis_url, tenant="vpc", key_prefix=prefix) as c:
        sub = await c.submit("minilm", {"text": "inside the VPC"})
        res = await c.result(sub.id, timeout=20)
        assert res.status == "succeeded"
        with pytest.raises(InvalidRequest):
            await c.submit("minilm", {"nope": 1})
    for bad in ("bad:tenant", "", "two words"):  # refused as the CLI refuses it, before any key is written
        with pytest.raises(ValueError, match="tenant"):
            AsyncBatchgateClient.direct(redis_url, tenant=bad, key_prefix=prefix)


async def test_the_direct_client_refuses_what_the_http_client_refuses_in_the_same_words(redis_url, prefix):
    """Direct mode promises the HTTP API's statuses and errors: a value JSON cannot carry (bytes raised a bare
    TypeError, NaN got a 422 about its range) is the same `InvalidRequest` 400 before anything is stored; a model
    name that needs quoting is named as the caller wrote it (`'a%20b'`)."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw, \
            AsyncBatchgateClient(gw.base_url) as http, \
            AsyncBatchgateClient.direct(redis_url, tenant="default", key_prefix=prefix) as direct:
        for inp, params in (({"prompt": b"x"}, None), ({"prompt": "x"}, {"temperature": float("nan")})):
            errors = []
            for c in (http, direct):
                with pytest.raises(InvalidRequest) as err:
                    await c.submit("tiny-llama", inp, params=params)
                errors.append((err.value.status, err.value.code, str(err.value)))
            assert errors[0] == errors[1] and errors[0][:2] == (400, "invalid_request"), errors
        for c in (http, direct):
            with pytest.raises(NotFound, match="'a b'"):
                await c.submit("a b", {"prompt": "x"})
        assert sum((await gw.service.backlog("tiny-llama", ("short", "medium", "long"))).values()) == 0


async def test_the_direct_client_reads_the_deployments_settings(redis_url, prefix, monkeypatch):
    """Direct mode serves the deployment's models, as its gateway does: the process environment's models file (and
    key prefix), unless `env` gives the settings instead."""
    monkeypatch.setenv("BATCHGATE_CONFIG_YAML", "models:\n  - {name: myecho, task: generate, kind: echo}\n")
    monkeypatch.setenv("BATCHGATE_KEY_PREFIX", prefix)
    async with AsyncBatchgateClient.direct(redis_url, tenant="vpc") as c:
        sub = await c.submit("myecho", {"prompt": "hi"}, params={"max_new_tokens": 2})
        assert sub.status == "queued"  # no worker: accepted, under the environment's prefix
        assert (await c.get(sub.id)).status == "queued"
        await c.cancel(sub.id)
    async with AsyncBatchgateClient.direct(redis_url, tenant="vpc", key_prefix=prefix, env={}) as c:
        with pytest.raises(NotFound):  # settings given: the built-in models only
            await c.submit("myecho", {"prompt": "hi"})


async def test_auth_tenants_isolation_revocation_and_rate_limit(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, auth="api_key")
    async with running_gateway(settings) as gw:
        a_key, b_key = await keys_for(gw, "tenant-a", "tenant-b")
        body = {"input": {"text": "x"}}
        assert (await gw.client.post("/v1/models/minilm/requests", json=body)).status_code == 401
        r = await gw.client.post("/v1/models/minilm/requests", json=body, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await gw.client.post("/v1/models/minilm/requests", json=body, headers={"X-API-Key": a_key})
        assert r.status_code == 202
        rid = r.json()["id"]
        # another tenant sees nothing: 404, not 403
        assert (await gw.client.get(f"/v1/requests/{rid}", headers={"X-API-Key": b_key})).status_code == 404
        assert (await gw.client.delete(f"/v1/requests/{rid}", headers={"X-API-Key": b_key})).status_code == 404
        assert (await gw.client.get(f"/v1/requests/{rid}", headers={"X-API-Key": a_key})).status_code == 200
        assert (await gw.client.get("/healthz")).status_code == 200  # public
        # revocation (the key cache holds a lookup for at most a few seconds)
        store = TenantStore(gw.service.redis, Keys(prefix))
        assert await store.revoke_key(b_key) == "tenant-b"
        gw.service.auth._cache.clear()
        assert (await gw.client.get("/v1/models", headers={"X-API-Key": b_key})).status_code == 401
        # per-tenant rate limit: 2/s with a burst of 2
        await store.set("tenant-a", rate_per_s=2, burst=2)
        gw.service.auth._cache.clear()
        codes = [(await gw.client.post("/v1/models/minilm/requests", json=body, headers={"X-API-Key": a_key}))
                 for _ in range(4)]
        assert [c.status_code for c in codes][:2] == [202, 202] and codes[-1].status_code == 429
        assert codes[-1].json()["error"]["code"] == "rate_limited" and int(codes[-1].headers["retry-after"]) >= 1


async def test_tenant_backlog_quota(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, auth="api_key", tenant_max_backlog=2)
    async with running_gateway(settings) as gw:
        (key,) = await keys_for(gw, "quota")
        h = {"X-API-Key": key}
        codes = [(await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}}, headers=h))
                 .status_code for _ in range(3)]
        assert codes == [202, 202, 429]
        async with running_worker(settings, loaded_models):
            rid = (await gw.client.get("/v1/models", headers=h)).status_code
            assert rid == 200
            for _ in range(100):  # once the worker finished them, the quota frees up
                r = await gw.client.post("/v1/models/minilm/requests?wait=5", json={"input": {"text": "y"}}, headers=h)
                if r.status_code in (200, 202):
                    break
                await asyncio.sleep(0.1)
            assert r.status_code in (200, 202)


@pytest.mark.parametrize(("quota", "holds"), [(0, False), (5, True)])
async def test_a_request_says_whether_it_holds_a_quota_slot(redis_url, prefix, quota, holds):
    """Only a request that took a slot in its tenant's backlog quota makes its end give one back (a ZREM per
    request for tenants without a quota is a Redis command of every lifecycle spent on nothing)."""
    from shared.codec import decode
    from shared.messages import InferenceRequest

    settings = make_settings(redis_url, prefix, tenant_max_backlog=quota)
    async with running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/minilm/requests", json={"input": {"text": "x"}})
        assert r.status_code == 202
        stream = Keys(prefix).lane_stream("minilm", r.json()["lane"])
        ((_, fields),) = await gw.service.redis.xrange(stream)
        req = decode(fields[b"m"], InferenceRequest)
        assert req.id == r.json()["id"] and req.quota_slot is holds
        active = await gw.service.redis.zrange(Keys(prefix).tenant_active(req.tenant), 0, -1)
        assert (req.id.encode() in active) is holds


async def test_openapi_document_and_docs_page(redis_url, prefix):
    settings = make_settings(redis_url, prefix, auth="api_key")
    async with running_gateway(settings) as gw:
        doc = (await gw.client.get("/openapi.json")).json()
        assert doc["openapi"].startswith("3.")
        ops = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
        from gateway.routes import ROUTES
        assert {(r.method, r.path) for r in ROUTES} <= ops  # every route is documented
        page = await gw.client.get("/docs")
        assert page.status_code == 200 and "/v1/models/{model}/requests" in page.text


async def test_sdk_streams_tokens_over_http_sync_async_and_direct(redis_url, prefix, loaded_models):
    settings = make_settings(redis_url, prefix, auth="api_key")
    params = {"max_new_tokens": 12, "ignore_eos": True}
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw:
        key, other = await keys_for(gw, "acme", "rival")
        async with AsyncBatchgateClient(gw.base_url, api_key=key) as c:
            sub = await c.submit("tiny-llama", {"prompt": "stream me"}, params=params, stream=True)
            events = [e async for e in c.events(sub.id)]
            assert events[-1].event == "done" and events[-1].data["status"] == "succeeded"
            text = "".join(e.text for e in events)
            assert text == events[-1].data["output"]["text"] and sum(e.event == "delta" for e in events) >= 4
            # resuming after the id of a delta gives exactly what came after it
            deltas = [e for e in events if e.event == "delta"]
            # each delta tells the prompt's tokens, as the result counts them
            assert {e.data["prompt_tokens"] for e in deltas} == {events[-1].data["output"]["prompt_tokens"]}
            rest = [e async for e in c.events(sub.id, last_event_id=deltas[2].id)]
            assert "".join(e.text for e in rest) == "".join(e.text for e in deltas[3:])
        async with AsyncBatchgateClient(gw.base_url, api_key=other) as c:
            with pytest.raises(NotFound):  # another tenant's request: its events are not there either
                _ = [e async for e in c.events(sub.id)]

        def sync_scenario() -> str:
            with BatchgateClient(gw.base_url, api_key=key) as c:
                s = c.submit("tiny-llama", {"prompt": "stream me"}, params=params, stream=True)
                return "".join(e.text for e in c.events(s.id))

        assert await asyncio.to_thread(sync_scenario) == text  # greedy: the same tokens
    async with running_worker(settings, loaded_models), \
            AsyncBatchgateClient.direct(redis_url, tenant="vpc", key_prefix=prefix) as c:
        sub = await c.submit("tiny-llama", {"prompt": "stream me"}, params=params, stream=True)
        events = [e async for e in c.events(sub.id)]
        assert "".join(e.text for e in events) == text and events[-1].event == "done"


async def test_submit_many_sends_every_field_and_reports_where_a_replayed_request_is(redis_url, prefix,
                                                                                       loaded_models):
    settings = make_settings(redis_url, prefix)
    params = {"max_new_tokens": 6, "ignore_eos": True}
    async with running_worker(settings, loaded_models), running_gateway(settings) as gw, \
            AsyncBatchgateClient(gw.base_url) as c:
        (sub,) = await c.submit_many("tiny-llama", [{"input": {"prompt": "a"}, "params": params, "stream": True,
                                                     "idempotency_key": "many-1"}])
        assert isinstance(sub, Submission) and sub.status == "queued"
        events = [e async for e in c.events(sub.id)]  # it was submitted to stream: its tokens come as deltas
        assert sum(e.event == "delta" for e in events) >= 2 and events[-1].data["status"] == "succeeded"
        # the same key again: the finished request, said to be finished (it was reported 'queued')
        (again,) = await c.submit_many("tiny-llama", [{"input": {"prompt": "a"}, "params": params, "stream": True,
                                                       "idempotency_key": "many-1"}])
        assert isinstance(again, Submission) and (again.id, again.status) == (sub.id, "succeeded")
        # a field the gateway does not know is named, not dropped
        (typo,) = await c.submit_many("tiny-llama", [{"input": {"prompt": "a"}, "timeout": 5}])
        assert isinstance(typo, InvalidRequest) and "timeout: unknown field" in str(typo)


async def test_a_401_says_how_to_authenticate(redis_url, prefix, loaded_models):
    """Every 401 carries `WWW-Authenticate: Bearer` (RFC 6750); credentials of another scheme (Basic) are not a
    missing key but a scheme batchgate does not take, and the message says what it does take."""
    settings = make_settings(redis_url, prefix, auth="api_key")
    async with running_gateway(settings) as gw:
        (key,) = await keys_for(gw, "acme")
        body = {"input": {"text": "x"}}
        missing = await gw.client.post("/v1/models/minilm/requests", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        assert missing.headers["www-authenticate"].startswith("Bearer ")
        wrong = await gw.client.post("/v1/models/minilm/requests", json=body, headers={"Authorization": "Bearer no"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
        basic = await gw.client.post("/v1/models/minilm/requests", json=body,
                                     headers={"Authorization": "Basic dXNlcjpwYXNz"})
        assert basic.status_code == 401 and basic.headers["www-authenticate"].startswith("Bearer ")
        error = basic.json()["error"]
        assert error["code"] == "unsupported_auth_scheme", error
        assert "Basic" in error["message"] and "Bearer" in error["message"] and "X-API-Key" in error["message"]
        # the OpenAI routes answer in OpenAI's shape, with the same header
        openai = await gw.client.get("/v1/models", headers={"Authorization": "Basic dXNlcjpwYXNz"})
        assert openai.status_code == 401 and openai.headers["www-authenticate"].startswith("Bearer ")
        # an X-API-Key beside another scheme's Authorization (a proxy's own credentials) is still used
        ok = await gw.client.get("/v1/models", headers={"Authorization": "Basic dXNlcjpwYXNz", "X-API-Key": key})
        assert ok.status_code == 200
        # two different keys: which one was meant is not known (the same key twice is one key)
        both = await gw.client.post("/v1/models/minilm/requests", json=body,
                                    headers={"Authorization": f"Bearer {key}", "X-API-Key": key + "x"})
        assert both.status_code == 401 and both.json()["error"]["code"] == "conflicting_api_keys", both.text
        same = await gw.client.post("/v1/models/minilm/requests", json=body,
                                    headers={"Authorization": f"Bearer {key}", "X-API-Key": key})
        assert same.status_code == 202, same.text
        # one header sent twice with two values (the last one won): which was meant is not known
        for name, other in (("Authorization", "Bearer bgk_other"), ("X-API-Key", "bgk_other"),
                            ("Idempotency-Key", "k2")):
            mine = f"Bearer {key}" if name == "Authorization" else key if name == "X-API-Key" else "k1"
            twice = await gw.client.post("/v1/models/minilm/requests", json=body, headers=[
                *([] if name != "Idempotency-Key" else [("Authorization", f"Bearer {key}")]),
                (name, mine), (name, other)])
            assert twice.status_code == 400 and twice.json()["error"]["code"] == "repeated_header", twice.text
        same_twice = await gw.client.get("/v1/models", headers=[("X-API-Key", key), ("X-API-Key", key)])
        assert same_twice.status_code == 200, same_twice.text
        # an empty Bearer (a client whose token variable was unset) beside an X-API-Key: the key
        for empty in ("Bearer", "bearer"):
            got = await gw.client.get("/v1/models", headers={"Authorization": empty, "X-API-Key": key})
            assert got.status_code == 200, got.text
        # a key sent without `Bearer ` is not echoed back: error bodies end up in clients' and proxies' logs
        for raw in (key, f"Bearer\t{key}", f"{key[:12]} x"):
            bare = await gw.client.get("/v1/models/minilm", headers={"Authorization": raw})
            assert bare.status_code == 401 and bare.json()["error"]["code"] == "unsupported_auth_scheme", bare.text
            assert key[:8] not in bare.text and "Bearer <key>" in bare.text, bare.text


def test_direct_mode_writes_nothing_to_the_callers_stdout(redis_url, prefix):
    """The SDK is a library inside the caller's program: direct mode runs the gateway's operations, whose log lines
    (a request accepted, at INFO) go through `logging` (silent below WARNING unless the program says otherwise), not
    to stdout as structlog does unconfigured. Nothing global changes: a program that configured structlog keeps its
    configuration (batchgate's lines follow it), and one that did not keeps structlog's default for its own lines."""
    import subprocess
    import sys

    program = f"""
import asyncio, structlog
from shared.sdk import AsyncBatchgateClient

async def main():
    async with AsyncBatchgateClient.direct({redis_url!r}, tenant="lib", key_prefix={prefix!r}) as c:
        sub = await c.submit("minilm", {{"text": "quiet"}})
        await c.cancel(sub.id)
    return sub.id

if CONFIGURED:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory())
print(asyncio.run(main()))
structlog.get_logger("app").info("the program's own line")
"""
    for configured in (False, True):
        out = subprocess.run([sys.executable, "-c", f"CONFIGURED = {configured}\n{program}"], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        lines = out.stdout.splitlines()
        assert "the program's own line" in lines[-1], out.stdout  # structlog as the program left it, either way
        if configured:  # the program's own structlog set-up is left as it is: batchgate's lines print where it said
            assert any("request accepted" in line for line in lines), out.stdout
        else:
            assert len(lines) == 2 and lines[0].startswith("req_"), out.stdout  # only what the program wrote
            assert "request accepted" not in out.stderr


async def test_leaving_the_sync_stream_early_returns_at_once(redis_url, prefix):
    """The sync client's `stream` yields results as they finish; a caller that breaks out after the first is not held
    until the others finish (or their `timeout`), as the async client's is not: before, leaving the loop waited for
    every long-poll still out."""
    settings = make_settings(redis_url, prefix)
    async with running_gateway(settings) as gw:  # no worker: the second request stays queued

        def scenario() -> tuple[str, float, float]:
            with BatchgateClient(gw.base_url) as c:
                first = c.submit("minilm", {"text": "one"})
                queued = c.submit("minilm", {"text": "two"})
                c.cancel(first.id)  # finished (cancelled) at once
                t0 = time.monotonic()
                results = c.stream([first.id, queued.id], timeout=20)
                res = next(results)
                results.close()  # what a `break` out of the loop does
                left_after = time.monotonic() - t0
                assert c.get(queued.id).status == "queued"
                c.cancel(queued.id)
                t0 = time.monotonic()
                # read to the end, the loop still gives every result (the second once cancelled above)
                both = {r.id: r.status for r in c.stream([first.id, queued.id], timeout=20)}
                assert both == {first.id: "cancelled", queued.id: "cancelled"}
                return res.id, left_after, time.monotonic() - t0

        got, left_after, whole = await asyncio.to_thread(scenario)
        assert got.startswith("req_")
        assert left_after < 2.0, left_after  # not the 20 s the queued request's long-poll could take
        assert whole < 5.0
