"""Every answer carries an `X-Request-Id`, errors included (OpenAI's clients show it with the error, as
`request_id`): a call refused before it became a request gets an `err_` id of its own, logged with the error; an
error about a request keeps that request's id. On every transport: the app (and Lambda through it) and
`routes.handle` (Cloud Functions, direct Lambda invocations)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import openai
import pytest
import structlog
from openai import AsyncOpenAI

from gateway import routes
from gateway.api import ApiRequest
from shared.ids import new_request_id
from tests.stack import RunningGateway, make_settings, running_gateway

pytestmark = [pytest.mark.redis]

ERROR_ID = re.compile(r"^err_[0-9a-f]{20}$")


@pytest.fixture
async def gw(redis_url: str, prefix: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(make_settings(redis_url, prefix)) as running:  # no worker: nothing here is stored
        yield running


async def test_the_openai_client_sees_an_id_on_every_error(gw: RunningGateway) -> None:
    client = AsyncOpenAI(base_url=f"{gw.base_url}/v1", api_key="none", max_retries=0)
    seen = set()
    try:
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(openai.BadRequestError) as bad:
                await client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=4)
            with pytest.raises(openai.NotFoundError) as unknown:
                await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(openai.NotFoundError) as no_route:
                await client.post("/no-such-route", cast_to=object)
        for info in (bad, unknown, no_route):
            assert info.value.request_id is not None and ERROR_ID.match(info.value.request_id), info.value
            seen.add(info.value.request_id)
    finally:
        await client.close()
    assert len(seen) == 3  # one per call
    refused = {e["error_id"]: e for e in logs if e.get("event") == "call refused"}
    assert set(refused) == seen  # an operator finds each one in the log, with what it was
    assert refused[bad.value.request_id]["status"] == 400 and refused[unknown.value.request_id]["status"] == 404
    assert refused[no_route.value.request_id]["path"] == "/v1/no-such-route"


async def test_native_errors_carry_an_id_and_successes_keep_theirs(gw: RunningGateway) -> None:
    for method, path, body, status in [
        ("POST", "/v1/models/tiny-llama/requests", b"{not json", 400),
        ("POST", "/v1/models/nope/requests", b'{"input": {"prompt": "x"}}', 404),
        ("GET", "/v1/requests/req_notanid", None, 404),
        ("DELETE", "/v1/models", None, 405),  # Starlette's own 405, in the route's shape
    ]:
        r = await gw.client.request(method, path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, r.text
        assert ERROR_ID.match(r.headers["x-request-id"]), (path, r.headers)
    # a stream's place sent twice with two values: which one was meant is not known (the last one won)
    twice = await gw.client.get(f"/v1/requests/{new_request_id()}/events",
                                headers=[("Last-Event-ID", "3"), ("Last-Event-ID", "9")])
    assert twice.status_code == 400 and twice.json()["error"]["code"] == "repeated_header", twice.text
    assert ERROR_ID.match(twice.headers["x-request-id"])
    ok = await gw.client.get("/healthz")
    assert ok.status_code == 200 and "x-request-id" not in ok.headers  # no call to name: nothing invented


async def test_the_transport_neutral_handler_names_its_errors(gw: RunningGateway) -> None:
    """Cloud Functions and direct Lambda invocations answer through `routes.handle`."""
    for req in (ApiRequest(method="POST", path="/v1/models/tiny-llama/requests", query={}, headers={}, body=b"[]"),
                ApiRequest(method="GET", path="/v2/nothing", query={}, headers={}, body=b"")):
        resp = await routes.handle(gw.service, req)
        assert resp.status >= 400 and ERROR_ID.match(resp.headers["X-Request-Id"]), resp
