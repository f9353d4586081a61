"""`BATCHGATE_LOG_FORMAT=json`: every line the gateway and a worker write is one JSON object, those of the libraries
they run too (uvicorn's start and stop, transformers' load report, no progress bars), so a pipeline that reads one
JSON object per line reads them all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from shared.embedded_redis import free_port
from tests.stack import gateway_process

pytestmark = [pytest.mark.redis]


def json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(obj, dict) and "event" in obj and "level" in obj and "timestamp" in obj, line
        lines.append(obj)
    return lines


async def test_every_line_of_a_gateway_and_a_worker_is_json(redis_url, prefix, tmp_path, loaded_models, model_cache):
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_KEY_PREFIX": prefix, "BATCHGATE_AUTH": "off",
           "BATCHGATE_HOST": "127.0.0.1", "BATCHGATE_PORT": str(free_port()), "BATCHGATE_MODELS": "tiny-llama",
           "BATCHGATE_MODEL_CACHE": str(model_cache), "BATCHGATE_LOG_FORMAT": "json", "BATCHGATE_LOG_LEVEL": "info",
           "BATCHGATE_WORKER_METRICS_PORT": "0", "BATCHGATE_WORKER_NAME": f"{prefix}-json"}
    gateway, base = gateway_process(env, tmp_path / "gateway.log")
    worker_log = tmp_path / "worker.log"
    worker = subprocess.Popen([sys.executable, "-m", "batchgate", "worker"], env=env, stdout=worker_log.open("w"),
                              stderr=subprocess.STDOUT)
    try:
        r = httpx.post(base + "/v1/models/tiny-llama/requests?wait=60", timeout=90,
                       json={"input": {"prompt": "hello"}, "params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and r.json()["status"] == "succeeded", r.text
    finally:
        for proc in (gateway, worker):
            proc.send_signal(signal.SIGTERM)
        for proc in (gateway, worker):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    gateway_lines = json_lines((tmp_path / "gateway.log").read_text())
    worker_lines = json_lines(worker_log.read_text())
    events = [x["event"] for x in gateway_lines]
    assert any("Uvicorn running" in e for e in events) and any(e == "request accepted" for e in events), events
    assert any(x.get("logger", "").startswith("uvicorn") for x in gateway_lines)  # a library's record, as JSON
    assert any(x["event"] == "worker ready" for x in worker_lines), worker_lines
