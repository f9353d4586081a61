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
