"""A gateway asked to stop (SIGTERM) while requests are in flight: the real `batchgate gateway` process, real
Redis, a real worker with the echo model (its steps take a known time)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from gateway.openai_api import CHOICE_IDS_HEADER
from gateway.service import GatewayService
from shared.config import ModelSpec
from shared.embedded_redis import free_port
from shared.states import Task
from tests.stack import gateway_process, make_settings, running_worker

pytestmark = [pytest.mark.redis]

STEP_MS = 20
GRACE_S = 4.0  # the waiters are released 2 s after the signal (gateway.server.RELEASE_MARGIN_S)
ECHO = ModelSpec(name="echo", task=Task.GENERATE, source="", kind="echo", max_input_tokens=128,
                 max_new_tokens=2000, step_ms=STEP_MS).validate()
ECHO_YAML = (f"models:\n  - {{name: echo, task: generate, kind: echo, max_input_tokens: 128, "
             f"max_new_tokens: 2000, step_ms: {STEP_MS}}}\n")


def start_gateway(redis_url: str, prefix: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_AUTH": "off",
           "BATCHGATE_HOST": "127.0.0.1", "BATCHGATE_PORT": str(free_port()), "BATCHGATE_CONFIG_YAML": ECHO_YAML,
           "BATCHGATE_MODELS": "echo", "BATCHGATE_SHUTDOWN_GRACE_S": str(GRACE_S)}
    return gateway_process(env, log)


async def read_stream(client: httpx.AsyncClient, tokens: int, started: asyncio.Event) -> list[tuple[str, dict]]:
    """The events of a streamed submit, (name, data) in order; `started` is set at the first delta."""
    events: list[tuple[str, dict]] = []
    name = ""
    async with client.stream("POST", "/v1/models/echo/requests", headers={"accept": "text/event-stream"},
                             json={"input": {"prompt": "hello"}, "params": {"max_new_tokens": tokens},
                                   "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.split(":", 1)[1])))
                if name == "delta":
                    started.set()
    return events


async def test_a_stopping_gateway_finishes_what_comes_in_time_and_ends_the_rest_cleanly(redis_url, prefix,
                                                                                       tmp_path):
    """In flight at SIGTERM: a stream that ends within the grace gets its `done` event; a stream and a
    long-poll that would take 20 s are answered 2 s before the grace ends, each as a whole response (the
    stream's last event an `error` to reconnect with, the long-poll the record as it stands); the gateway
    exits 0 within the grace. Before, the first signal cut every stream mid-response."""
    settings = make_settings(redis_url, prefix, models=(ECHO,), drain_budget_s=0.5)  # the test's own end: quick
    proc, base = start_gateway(redis_url, prefix, tmp_path / "gateway.log")
    try:
        async with running_worker(settings, {}), httpx.AsyncClient(base_url=base, timeout=30) as client:
            short_started, long_started = asyncio.Event(), asyncio.Event()
            short = asyncio.create_task(read_stream(client, 60, short_started))  # 60 steps: ~1.2 s
            long = asyncio.create_task(read_stream(client, 1000, long_started))  # ~20 s
            waited = asyncio.create_task(client.post("/v1/models/echo/requests?wait=30", json={
                "input": {"prompt": "hello"}, "params": {"max_new_tokens": 1000}}))
            await asyncio.wait_for(asyncio.gather(short_started.wait(), long_started.wait()), 10)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            short_events, long_events, got = await asyncio.wait_for(asyncio.gather(short, long, waited), 15)
            answered_s = time.monotonic() - signalled
            code = await asyncio.to_thread(proc.wait, 15)
            exited_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "gateway.log").read_text()
    assert short_events[-1][0] == "done" and short_events[-1][1]["status"] == "succeeded", short_events[-3:]
    assert short_events[-1][1]["output"]["completion_tokens"] == 60
    assert long_events[-1][0] == "error" and long_events[-1][1]["error"]["code"] == "unavailable"
    assert "reconnect" in long_events[-1][1]["error"]["message"]
    assert not any(name == "done" for name, _ in long_events)
    assert got.status_code == 202 and got.json()["status"] in ("queued", "running"), got.text
    assert GRACE_S - 2 - 0.5 <= answered_s <= GRACE_S, answered_s
    # uvicorn re-raises the SIGTERM it handled once it has shut down: the exit of a clean stop on it
    assert code in (0, -signal.SIGTERM) and exited_s < GRACE_S + 2, (code, exited_s, log[-2000:])
    assert "without completing response" not in log and "timeout graceful shutdown exceeded" not in log, log[-2000:]


async def read_openai_stream(client: httpx.AsyncClient, path: str, body: dict, started: asyncio.Event,
                             headers: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(event name, data) of an OpenAI-route stream, in order; `started` is set at the first data line."""
    out: list[tuple[str, str]] = []
    name = ""
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                out.append((name, line.split(":", 1)[1].strip()))
                name = ""
                started.set()
    return out


async def test_openai_calls_at_shutdown_end_in_openai_s_shape_saying_what_to_do(redis_url, prefix, tmp_path):
    """OpenAI's streams carry no event ids, so "reconnect with Last-Event-ID" cannot apply to them: at the
    grace's end a completions stream ends with an OpenAI error (then `[DONE]`), a Responses stream with
    `response.failed`, a waiting call with a 503 OpenAI's clients retry; each says the call can be sent again
    (with the same Idempotency-Key: its request goes on, for that retry to find), and the log says why a
    request was cancelled. Before, each got the native stream's message, and a waiting call a 504 blaming the
    gateway's longest wait."""
    settings = make_settings(redis_url, prefix, models=(ECHO,), drain_budget_s=0.5)
    proc, base = start_gateway(redis_url, prefix, tmp_path / "gateway.log")
    body = {"model": "echo", "prompt": "hello", "max_tokens": 1000}
    try:
        async with running_worker(settings, {}), httpx.AsyncClient(base_url=base, timeout=30) as client:
            began = [asyncio.Event() for _ in range(3)]
            plain = asyncio.create_task(read_openai_stream(client, "/v1/completions", body, began[0]))
            keyed = asyncio.create_task(read_openai_stream(client, "/v1/completions", body, began[1],
                                                           {"Idempotency-Key": f"{prefix}-k"}))
            resp = asyncio.create_task(read_openai_stream(client, "/v1/responses", {
                "model": "echo", "input": "hello", "max_output_tokens": 1000}, began[2]))
            waiting = asyncio.create_task(client.post("/v1/completions", json=body))
            two = asyncio.create_task(client.post("/v1/completions", json={**body, "n": 2}))
            two_keyed = asyncio.create_task(client.post("/v1/completions", json={**body, "n": 2},
                                                        headers={"Idempotency-Key": f"{prefix}-n2"}))
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in began)), 10)
            await asyncio.sleep(0.3)  # the waiting calls' requests are in
            proc.send_signal(signal.SIGTERM)
            plain_ev, keyed_ev, resp_ev, got, got_two, got_keyed = await asyncio.wait_for(
                asyncio.gather(plain, keyed, resp, waiting, two, two_keyed), 15)
            await asyncio.to_thread(proc.wait, 15)
            svc = GatewayService(settings)  # what the calls' requests became, read right after
            try:
                states = {rid: (await svc.get(rid)).state.value for r in (got, got_two, got_keyed)
                          for rid in r.headers.get(CHOICE_IDS_HEADER, r.headers["x-request-id"]).split(",")}
            finally:
                await svc.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "gateway.log").read_text()
    for events, fate in ((plain_ev, "were cancelled: send the call again"), (keyed_ev, "same Idempotency-Key")):
        assert events[-1] == ("", "[DONE]") and not any(name == "error" for name, _ in events), events[-3:]
        err = json.loads(events[-2][1])["error"]
        assert err["code"] == "unavailable" and "shutting down" in err["message"] and fate in err["message"], err
        assert "Last-Event-ID" not in err["message"]
    name, data = resp_ev[-1]
    assert name == "response.failed" and "shutting down" in json.loads(data)["response"]["error"]["message"]
    assert got.status_code == 503 and got.headers["x-should-retry"] == "true", got.text
    assert "shutting down" in got.json()["error"]["message"] and "send the call again" in got.json()["error"]["message"]
    assert "gateway shutting down: request cancelled" in log and "caller gone: request cancelled" not in log
    for r, fate in ((got_two, "were cancelled"), (got_keyed, "same Idempotency-Key")):
        ids = r.headers[CHOICE_IDS_HEADER].split(",")
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
        assert len(ids) == 2 and all(i in r.json()["error"]["message"] for i in ids) and fate in r.text, r.text
        assert r.headers["x-request-id"] == ids[0] and r.headers["retry-after"] == "1"
    # every choice of an unkeyed call is cancelled before the gateway lets go of Redis; a keyed call's go on
    cancelled = [got.headers["x-request-id"], *got_two.headers[CHOICE_IDS_HEADER].split(",")]
    assert all(states[i] == "cancelled" for i in cancelled), states
    assert all(states[i] != "cancelled" for i in got_keyed.headers[CHOICE_IDS_HEADER].split(",")), states
