"""The echo model (`kind: echo`) end to end: the real gateway over HTTP, real Redis, a real worker, no model."""

from __future__ import annotations

import pytest

from shared.config import ModelSpec
from shared.states import Task
from tests.stack import make_settings, running_gateway, running_worker

pytestmark = [pytest.mark.redis]

ECHO = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=128,
                 max_new_tokens=64).validate()


async def test_an_echo_model_answers_through_the_gateway_and_the_worker(redis_url, prefix):
    settings = make_settings(redis_url, prefix, models=(ECHO,))
    async with running_worker(settings, {}) as w, running_gateway(settings) as gw:
        r = await gw.client.post("/v1/models/echo/requests?wait=10", json={
            "input": {"prompt": "hello"}, "params": {"max_new_tokens": 8}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == "succeeded" and body["finish_reason"] == "length"
        assert body["output"]["text"] == "hellohel" and body["output"]["prompt_tokens"] == 5
        assert body["timings"]["compute_ms"] >= 0 and body["attempts"] == 1
        # the asynchronous path: a 202, then a long-poll woken by the done event
        r = await gw.client.post("/v1/models/echo/requests", json={
            "input": {"input_ids": [104, 105]}, "params": {"max_new_tokens": 3, "stop": ["ih"]}})
        assert r.status_code == 202, r.text
        got = (await gw.client.get(f"/v1/requests/{r.json()['id']}?wait=10")).json()
        assert got["status"] == "succeeded" and got["finish_reason"] == "stop" and got["output"]["text"] == "h"
        # the gateway counts the echo model's tokens (UTF-8 bytes) and refuses what is too long at submit
        r = await gw.client.post("/v1/models/echo/requests", json={"input": {"prompt": "é" * 65}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "input.prompt"
        models = (await gw.client.get("/v1/models")).json()["models"]
        assert models[0]["kind"] == "echo" and models[0]["workers"] == 1
        assert w.model_calls("echo") and all(n == 1 for n in w.model_calls("echo").values())
