"""Serverless callers: AWS Lambda (API Gateway v1/v2, Function URL, ALB, direct, SQS) and Google Cloud
Functions adapters, against real Redis and a real worker process."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.keys import Keys
from shared.redis_io import delete_prefix_sync, make_sync_redis

pytestmark = [pytest.mark.redis, pytest.mark.slow]


class FakeContext:
    def __init__(self, remaining_ms: int) -> None:
        self._end = time.monotonic() + remaining_ms / 1000
        self.aws_request_id = "c0ffee"

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._end - time.monotonic()) * 1000))


@pytest.fixture(scope="module")
def stack_env(redis_url: str, model_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A worker process (both built-in models) and the environment the handler modules read."""
    prefix = f"bgtest-sl{os.getpid()}"
    env = {"BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_MODEL_CACHE": str(model_cache),
           "BATCHGATE_AUTH": "api_key", "BATCHGATE_WORKER_METRICS_PORT": "0", "BATCHGATE_LOG_FORMAT": "json",
           "BATCHGATE_INTAKE_BLOCK_MS": "200"}
    log = tmp_path_factory.mktemp("sl") / "worker.log"
    proc = subprocess.Popen([sys.executable, "-m", "batchgate", "worker"], env={**os.environ, **env},
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    r = make_sync_redis(redis_url)
    end = time.monotonic() + 120
    while not r.hlen(f"{prefix}:workers"):
        assert proc.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
        time.sleep(0.1)
    try:
        yield env
    finally:
        proc.terminate()
        proc.wait(60)
        delete_prefix_sync(redis_url, prefix)


def load(module: str, env: dict[str, str], monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A fresh import of a handler module, as a cold container would do, on a fresh event loop."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    asyncio.set_event_loop(asyncio.new_event_loop())
    sys.modules.pop(module, None)
    return importlib.import_module(module)


def api_key(env: dict[str, str], tenant: str = "t-lambda") -> str:
    from shared.tenants import TenantStore

    async def make() -> str:
        from shared.redis_io import make_redis

        r = make_redis(env["BATCHGATE_REDIS_URL"])
        key = await TenantStore(r, Keys(env["BATCHGATE_KEY_PREFIX"])).create_key(tenant)
        await r.aclose()
        return key

    return asyncio.run(make())


def body_of(resp: dict) -> dict:
    return json.loads(resp["body"])


BODY = json.dumps({"input": {"texts": ["hello"]}})


def apigw_v1(key: str, body: str = BODY, path: str = "/v1/models/minilm/requests", method: str = "POST") -> dict:
    headers = {"content-type": "application/json", "host": "abc123.execute-api.eu-west-1.amazonaws.com",
               "authorization": f"Bearer {key}"}
    return {
        "resource": "/{proxy+}", "path": path, "httpMethod": method, "headers": headers,
        "multiValueHeaders": {k: [v] for k, v in headers.items()},
        "queryStringParameters": {"wait": "20"}, "multiValueQueryStringParameters": {"wait": ["20"]},
        "pathParameters": {"proxy": path.lstrip("/")}, "stageVariables": None,
        "requestContext": {"resourcePath": "/{proxy+}", "httpMethod": method, "path": "/prod" + path,
                           "stage": "prod", "requestId": "r-1", "accountId": "123456789012",
                           "identity": {"sourceIp": "198.51.100.7", "userAgent": "curl"}},
        "body": body, "isBase64Encoded": False,
    }


def apigw_v2(key: str, body: str = BODY, path: str = "/v1/models/minilm/requests", method: str = "POST",
             domain: str = "abc123.execute-api.eu-west-1.amazonaws.com", stage: str = "$default") -> dict:
    """An HTTP API's event; a named `stage` begins the path, as API Gateway sends it on its execute-api URL (a
    custom domain's path holds no stage)."""
    if stage != "$default" and ".execute-api." in domain:
        path = f"/{stage}{path}"
    return {
        "version": "2.0", "routeKey": "$default", "rawPath": path, "rawQueryString": "wait=20",
        "headers": {"content-type": "application/json", "host": domain, "x-api-key": key},
        "queryStringParameters": {"wait": "20"},
        "requestContext": {"accountId": "123456789012", "apiId": "abc123", "domainName": domain,
                           "http": {"method": method, "path": path, "protocol": "HTTP/1.1",
                                    "sourceIp": "198.51.100.7", "userAgent": "curl"},
                           "requestId": "r-2", "routeKey": "$default", "stage": stage,
                           "time": "22/Nov/2026:05:00:00 +0000", "timeEpoch": 1795300000000},
        "body": body, "isBase64Encoded": False,
    }


def alb(key: str, body: str = BODY, path: str = "/v1/models/minilm/requests", method: str = "POST") -> dict:
    return {
        "requestContext": {"elb": {"targetGroupArn": "arn:aws:elasticloadbalancing:eu-west-1:123456789012:"
                                                     "targetgroup/batchgate/50dc6c495c0c9188"}},
        "httpMethod": method, "path": path, "queryStringParameters": {"wait": "20"},
        "headers": {"content-type": "application/json", "host": "batchgate-alb.example.com",
                    "x-api-key": key},
        "body": body, "isBase64Encoded": False,
    }


@pytest.mark.parametrize("shape", ["apigw_v1", "apigw_v2", "apigw_v2_stage", "apigw_v2_stage_v1",
                                   "apigw_v2_custom_domain_v1", "function_url", "alb"])
def test_lambda_http_events(stack_env, monkeypatch, shape):
    key = api_key(stack_env)  # (asyncio.run unsets the current loop: do it before the cold start)
    mod = load("gateway.lambda_handler", stack_env, monkeypatch)
    make = {"apigw_v1": apigw_v1, "apigw_v2": apigw_v2, "alb": alb,
            "apigw_v2_stage": lambda k, **kw: apigw_v2(k, stage="prod", **kw),  # was a 404: no route /prod/v1/...
            "apigw_v2_stage_v1": lambda k, **kw: apigw_v2(k, stage="v1", **kw),  # /v1/v1/models/...
            # a stage named as the API's own prefix behind a custom domain: the path is the app's (was /models...)
            "apigw_v2_custom_domain_v1": lambda k, **kw: apigw_v2(k, stage="v1", domain="api.example.com", **kw),
            "function_url": lambda k, **kw: apigw_v2(k, domain="xyz.lambda-url.eu-west-1.on.aws", **kw)}[shape]
    resp = mod.http_handler(make(key), FakeContext(30_000))
    assert resp["statusCode"] == 200, resp
    got = body_of(resp)
    assert got["status"] == "succeeded" and len(got["output"]["embeddings"][0]) == 384
    again = mod.http_handler(make(key, path=f"/v1/requests/{got['id']}", method="GET", body=""), FakeContext(30_000))
    assert again["statusCode"] == 200 and body_of(again)["id"] == got["id"]  # the same warm container, reused
    denied = mod.http_handler(make("bgk_wrong"), FakeContext(30_000))
    assert denied["statusCode"] == 401
    # a thawed container may hold connections the server dropped meanwhile: the next call reconnects
    r = make_sync_redis(stack_env["BATCHGATE_REDIS_URL"])
    mine = [c for c in r.client_list() if c.get("lib-name") == "redis-py" and int(c.get("db", 0)) == 0]
    for c in mine:
        if c["id"] != str(r.client_id()):
            r.client_kill_filter(_id=c["id"])
    thawed = mod.http_handler(make(key, path=f"/v1/requests/{got['id']}", method="GET", body=""), FakeContext(30_000))
    assert thawed["statusCode"] == 200
    doc = mod.http_handler(make(key, path="/openapi.json", method="GET", body=""), FakeContext(30_000))
    assert doc["statusCode"] == 200 and "/v1/models/{model}/requests" in body_of(doc)["paths"]


def test_lambda_direct_invocation_and_deadline_from_context(stack_env, monkeypatch):
    mod = load("gateway.lambda_handler", stack_env, monkeypatch)
    ok = mod.direct_handler({"model": "tiny-llama", "input": {"prompt": "hi"}, "params": {"max_new_tokens": 4},
                             "wait": 20}, FakeContext(25_000))
    assert ok["statusCode"] == 200 and ok["status"] == "succeeded" and ok["output"]["completion_tokens"] <= 4
    assert ok["deadline"] - time.time() < 25  # the deadline came from the invocation's remaining time
    r = make_sync_redis(stack_env["BATCHGATE_REDIS_URL"])
    keys = Keys(stack_env["BATCHGATE_KEY_PREFIX"])
    before = sum(r.xlen(s) for s in keys.lane_streams("tiny-llama", ("short", "medium", "long")))
    late = mod.direct_handler({"model": "tiny-llama", "input": {"prompt": "hi"}}, FakeContext(300))
    assert late["statusCode"] == 429 and late["error"]["code"] == "deadline_infeasible"
    after = sum(r.xlen(s) for s in keys.lane_streams("tiny-llama", ("short", "medium", "long")))
    assert after == before  # nothing was submitted, so nothing can be computed
    bad = mod.direct_handler({"input": {}}, FakeContext(5_000))
    assert bad["statusCode"] == 400


def test_lambda_sqs_batch_with_partial_failures_and_redelivery(stack_env, monkeypatch):
    key = api_key(stack_env, "t-sqs")  # (before the handler's loop: asyncio.run ends with no loop set)
    mod = load("gateway.lambda_handler", stack_env, monkeypatch)

    def record(mid: str, body: str) -> dict:
        return {"messageId": mid, "receiptHandle": "rh-" + mid, "body": body,
                "attributes": {"ApproximateReceiveCount": "1", "SentTimestamp": "1795300000000"},
                "messageAttributes": {}, "md5OfBody": "x", "eventSource": "aws:sqs",
                "eventSourceARN": "arn:aws:sqs:eu-west-1:123456789012:batchgate-in", "awsRegion": "eu-west-1"}

    event = {"Records": [
        record("m1", json.dumps({"model": "minilm", "input": {"text": "a"}})),
        record("m2", json.dumps({"model": "minilm", "input": {"text": "b"}})),
        record("m3", "{not json"),
        record("m4", json.dumps({"model": "minilm", "input": {"texts": [1]}})),
        record("m5", json.dumps({"model": "nope", "input": {"text": "c"}})),
        record("m6", json.dumps({"model": "tiny-llama", "input": {"prompt": "d"}, "params": {"max_new_tokens": 2}})),
        # a message's own key acts for its tenant; one that is not a key is refused, never taken as the Lambda's
        record("m7", json.dumps({"model": "minilm", "input": {"text": "e"}, "api_key": key})),
        record("m8", json.dumps({"model": "minilm", "input": {"text": "f"}, "api_key": "bogus"})),
    ]}
    out = mod.sqs_handler(event, FakeContext(30_000))
    assert sorted(f["itemIdentifier"] for f in out["batchItemFailures"]) == ["m3", "m4", "m5", "m8"]
    tenants = {}
    r0 = make_sync_redis(stack_env["BATCHGATE_REDIS_URL"])
    for key in r0.scan_iter(match=f"{stack_env['BATCHGATE_KEY_PREFIX']}:{{i:*", count=1000):
        tenants[key.decode().split("{i:")[1].split(":")[0]] = True
    assert "t-sqs" in tenants, tenants  # m7's idempotency key is its tenant's
    r = make_sync_redis(stack_env["BATCHGATE_REDIS_URL"])
    p = stack_env["BATCHGATE_KEY_PREFIX"]
    idem = list(r.scan_iter(match=f"{p}:{{i:*", count=1000))
    out2 = mod.sqs_handler({"Records": event["Records"][:2]}, FakeContext(30_000))  # SQS redelivers m1, m2
    assert out2["batchItemFailures"] == []
    assert len(list(r.scan_iter(match=f"{p}:{{i:*", count=1000))) == len(idem)  # no new requests


def test_cloud_functions_adapter(stack_env, monkeypatch):
    functions_framework = pytest.importorskip("functions_framework")
    for k, v in stack_env.items():
        monkeypatch.setenv(k, v)
    sys.modules.pop("gateway.gcf_handler", None)
    app = functions_framework.create_app(target="batchgate", source=str(Path("gateway/gcf_handler.py").resolve()))
    client = app.test_client()
    key = api_key(stack_env, "t-gcf")
    r = client.post("/v1/models/minilm/requests?wait=20", json={"input": {"text": "hello"}},
                    headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200 and r.get_json()["status"] == "succeeded"
    rid = r.get_json()["id"]
    assert client.get(f"/v1/requests/{rid}", headers={"X-API-Key": key}).status_code == 200
    assert client.get(f"/v1/requests/{rid}").status_code == 401
    assert client.get("/healthz").status_code == 200
    assert client.put("/v1/models", headers={"X-API-Key": key}).status_code == 405
    r = client.get("/v1/chat/completions", headers={"X-API-Key": key})  # OpenAI's error shape on its routes
    assert r.status_code == 405 and r.get_json()["error"]["type"] == "invalid_request_error", r.get_json()
    assert r.headers["Allow"] == "POST"
    # as the HTTP gateway answers: HEAD as GET without a body, a repeated query parameter's last value
    head = client.head(f"/v1/requests/{rid}", headers={"X-API-Key": key})
    assert head.status_code == 200 and head.data == b"" and int(head.headers["content-length"]) > 0
    assert "HEAD" in client.put(f"/v1/requests/{rid}", headers={"X-API-Key": key}).headers["Allow"].split(", ")
    r = client.get(f"/v1/requests/{rid}?wait=1&wait=abc", headers={"X-API-Key": key})
    assert r.status_code == 400 and r.get_json()["error"]["code"] == "invalid_wait"
    events = client.get(f"/v1/requests/{rid}/events", headers={"X-API-Key": key, "Accept": "text/event-stream"})
    assert events.status_code == 200 and events.headers["cache-control"] == "no-store"
    assert events.headers["x-accel-buffering"] == "no"
    # the API document, as the HTTP gateway and the Lambda serve it (no key needed: it is the same for everyone)
    doc = client.get("/openapi.json")
    assert doc.status_code == 200 and doc.get_json()["paths"]["/v1/models/{model}/requests"]
    page = client.get("/docs")
    assert page.status_code == 200 and page.mimetype == "text/html" and b"/openapi.json" in page.data


def test_cloud_functions_served_as_cloud_functions_serves_it(stack_env, tmp_path):
    """The functions-framework command Cloud Functions runs (gunicorn, which imports the handler and then forks
    its workers), not a test client: requests are answered in the forked worker (its event loop's thread started
    there; one started at import stayed in the parent, and every request waited forever)."""
    pytest.importorskip("functions_framework")
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "gcf.log"
    proc = subprocess.Popen([sys.executable, "-m", "functions_framework", "--target", "batchgate", "--source",
                             str(Path("gateway/gcf_handler.py").resolve()), "--host", "127.0.0.1", "--port",
                             str(port)], env={**os.environ, **stack_env, "PYTHONPATH": str(Path.cwd())},
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        base, end = f"http://127.0.0.1:{port}", time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/openapi.json", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
            time.sleep(0.2)
        assert httpx.get(f"{base}/healthz", timeout=10).status_code == 200, log.read_text()[-2000:]
        key = api_key(stack_env, "t-gcf-served")
        r = httpx.post(f"{base}/v1/models/minilm/requests?wait=20", json={"input": {"text": "hello"}},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("module", ["gateway.lambda_handler", "gateway.gcf_handler", "shared.sdk", "batchgate.cli"])
def test_handler_modules_import_no_torch(stack_env, module):
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **stack_env}, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert out[1:] == ["False", "False"], out


def test_lambda_serves_a_requests_events_whole(stack_env, monkeypatch):
    """A Lambda answers once: the event stream comes whole, in the SSE format, when the request is done."""
    key = api_key(stack_env)
    mod = load("gateway.lambda_handler", stack_env, monkeypatch)
    body = json.dumps({"input": {"prompt": "hi"}, "params": {"max_new_tokens": 6, "ignore_eos": True},
                       "stream": True})
    sub = mod.http_handler(apigw_v2(key, body=body, path="/v1/models/tiny-llama/requests"), FakeContext(30_000))
    assert sub["statusCode"] == 200, sub  # ?wait=20: the result
    rid = body_of(sub)["id"]
    event = apigw_v2(key, body="", path=f"/v1/requests/{rid}/events", method="GET")
    event["rawQueryString"], event["queryStringParameters"] = "", {}
    resp = mod.http_handler(event, FakeContext(30_000))
    assert resp["statusCode"] == 200 and resp["headers"]["content-type"].startswith("text/event-stream")
    text = resp["body"]
    datas = [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]
    assert "event: done" in text and datas[-1]["status"] == "succeeded"
    deltas = [d for d in datas[:-1] if "token_ids" in d]
    assert "".join(d["text"] for d in deltas) == datas[-1]["output"]["text"]
    assert [t for d in deltas for t in d["token_ids"]] == datas[-1]["output"]["token_ids"]
    # one still running: the answer waits for its end
    queued = apigw_v2(key, body=body.replace('"max_new_tokens": 6', '"max_new_tokens": 40'),
                      path="/v1/models/tiny-llama/requests")
    queued["rawQueryString"], queued["queryStringParameters"] = "", {}
    sub = mod.http_handler(queued, FakeContext(30_000))
    assert sub["statusCode"] == 202, sub
    running = apigw_v2(key, body="", path=f"/v1/requests/{body_of(sub)['id']}/events", method="GET")
    running["rawQueryString"], running["queryStringParameters"] = "", {}
    resp = mod.http_handler(running, FakeContext(30_000))
    datas = [json.loads(line[len("data: "):]) for line in resp["body"].splitlines() if line.startswith("data: ")]
    assert datas[-1]["status"] == "succeeded" and len(datas[-1]["output"]["token_ids"]) == 40


def test_a_lambda_answers_a_running_requests_events_within_its_longest_wait(stack_env, monkeypatch):
    """A Lambda answers once: a stream still going at BATCHGATE_MAX_WAIT_S ends there with an `error` event telling
    the caller to reconnect with Last-Event-ID (it held until the request ended: past a real function's timeout, the
    caller got a 502 and none of the events); an OpenAI stream, whose clients cannot reconnect, with an error chunk
    saying its request was cancelled. A body flagged base64 that is not is a 400, not a crash."""
    key = api_key(stack_env)
    mod = load("gateway.lambda_handler", {**stack_env, "BATCHGATE_MAX_WAIT_S": "0.3"}, monkeypatch)
    body = json.dumps({"input": {"prompt": "hi"}, "params": {"max_new_tokens": 256, "ignore_eos": True},
                       "stream": True, "timeout_s": 60})
    queued = apigw_v2(key, body=body, path="/v1/models/tiny-llama/requests")
    queued["rawQueryString"], queued["queryStringParameters"] = "", {}
    sub = mod.http_handler(queued, FakeContext(30_000))
    assert sub["statusCode"] == 202, sub
    rid = body_of(sub)["id"]
    events = apigw_v2(key, body="", path=f"/v1/requests/{rid}/events", method="GET")
    events["rawQueryString"], events["queryStringParameters"] = "", {}
    t0 = time.monotonic()
    resp = mod.http_handler(events, FakeContext(30_000))
    took = time.monotonic() - t0
    assert resp["statusCode"] == 200 and took < 10, took
    assert "event: error" in resp["body"] and "wait_exceeded" in resp["body"] and "Last-Event-ID" in resp["body"]
    cancel = apigw_v2(key, body="", path=f"/v1/requests/{rid}", method="DELETE")
    cancel["rawQueryString"], cancel["queryStringParameters"] = "", {}
    assert mod.http_handler(cancel, FakeContext(30_000))["statusCode"] == 200
    # an OpenAI stream cut there ends with an error chunk OpenAI's clients raise, its request cancelled: they
    # cannot reconnect
    chat = json.dumps({"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 256,
                       "stream": True, "ignore_eos": True, "timeout_s": 60})
    openai_call = apigw_v2(key, body=chat, path="/v1/chat/completions")
    openai_call["rawQueryString"], openai_call["queryStringParameters"] = "", {}
    resp = mod.http_handler(openai_call, FakeContext(30_000))
    assert resp["statusCode"] == 200, resp
    datas = [json.loads(line[len("data: "):]) for line in resp["body"].splitlines() if line.startswith("data: ")]
    error = datas[-1]["error"]
    assert error["code"] == "wait_exceeded" and "cancelled" in error["message"], error
    assert "Last-Event-ID" not in resp["body"]
    record = apigw_v2(key, body="", path=f"/v1/requests/{resp['headers']['x-request-id']}", method="GET")
    record["rawQueryString"], record["queryStringParameters"] = "wait=10", {"wait": "10"}
    assert body_of(mod.http_handler(record, FakeContext(30_000)))["status"] == "cancelled"
    bad = apigw_v2(key, body="%%%notbase64")
    bad["isBase64Encoded"] = True
    answer = mod.http_handler(bad, FakeContext(30_000))
    assert answer["statusCode"] == 400 and "base64" in answer["body"]
    # a function's /metrics would be one container's, on a public URL: not served there
    metrics = apigw_v2(key, body="", path="/metrics", method="GET")
    metrics["rawQueryString"], metrics["queryStringParameters"] = "", {}
    assert mod.http_handler(metrics, FakeContext(30_000))["statusCode"] == 404


def test_an_idempotency_key_sent_twice_is_refused_however_the_platform_joins_it(stack_env, monkeypatch):
    """API Gateway (a REST API's multi-value headers through Mangum, an HTTP API itself) and a Cloud Function's WSGI
    server join a header sent twice into one value with commas: two Idempotency-Keys were taken as a third key, so a
    retry with either one made a second request. A key holds no comma, so they are a 400 there, as the HTTP gateway
    answers a repeated header, and nothing is stored."""
    key = api_key(stack_env)
    mod = load("gateway.lambda_handler", stack_env, monkeypatch)
    r = make_sync_redis(stack_env["BATCHGATE_REDIS_URL"])
    keys_before = len(list(r.scan_iter(match=f"{stack_env['BATCHGATE_KEY_PREFIX']}:{{i:*", count=1000)))
    v1 = apigw_v1(key)
    v1["headers"]["idempotency-key"] = "kb-1"
    v1["multiValueHeaders"]["idempotency-key"] = ["ka-1", "kb-1"]
    v2 = apigw_v2(key)
    v2["headers"]["idempotency-key"] = "ka-2,kb-2"  # as an HTTP API sends a header it got twice
    for event in (v1, v2):
        resp = mod.http_handler(event, FakeContext(30_000))
        assert resp["statusCode"] == 400, resp
        assert body_of(resp)["error"]["code"] == "invalid_idempotency_key"
    functions_framework = pytest.importorskip("functions_framework")
    sys.modules.pop("gateway.gcf_handler", None)
    app = functions_framework.create_app(target="batchgate", source=str(Path("gateway/gcf_handler.py").resolve()))
    resp = app.test_client().post("/v1/models/minilm/requests", json={"input": {"text": "hello"}},
                                  headers=[("Authorization", f"Bearer {key}"), ("Idempotency-Key", "ka-3"),
                                           ("Idempotency-Key", "kb-3")])
    assert resp.status_code == 400 and resp.get_json()["error"]["code"] == "invalid_idempotency_key", resp.get_json()
    assert len(list(r.scan_iter(match=f"{stack_env['BATCHGATE_KEY_PREFIX']}:{{i:*", count=1000))) == keys_before
