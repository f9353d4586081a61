"""`batchgate up` as a user runs it: a subprocess on the embedded default, talked to over HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shared.embedded_redis import free_port

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("redis_mode", ["embedded", "external"])
def test_up_serves_both_models_and_stops_cleanly(model_cache, tmp_path, redis_mode, request):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BATCHGATE_REDIS_URL")}
    if redis_mode == "external":  # REDIS_URL points at an existing Redis: use it, under our own prefix
        env["REDIS_URL"] = request.getfixturevalue("redis_url")
        env["BATCHGATE_KEY_PREFIX"] = request.getfixturevalue("prefix")
    env["BATCHGATE_MODEL_CACHE"] = str(model_cache)
    env["BATCHGATE_LOG_FORMAT"] = "json"
    env["BATCHGATE_STATE_DIR"] = str(tmp_path / "state")  # not the user's own state file
    log = (tmp_path / "up.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "batchgate", "up", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 240
        while "batchgate is up" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < end, "batchgate up did not become ready"
            time.sleep(0.2)
        text = (tmp_path / "up.log").read_text()
        state = json.loads((tmp_path / "state" / "up.json").read_text())  # what the operations CLI reads
        assert state["redis_url"] in text and state["gateway"] == base
        if redis_mode == "embedded":
            assert "embedded redis" in text  # says which Redis it started
        else:
            assert "embedded redis" not in text and "(external)" in text
        with httpx.Client(base_url=base, timeout=30) as client:
            r = client.post("/v1/models/minilm/requests", json={"input": {"texts": ["hello"]}})
            assert r.status_code == 202
            got = client.get(f"/v1/requests/{r.json()['id']}", params={"wait": 10}).json()
            assert got["status"] == "succeeded" and len(got["output"]["embeddings"][0]) == 384
            r = client.post("/v1/models/tiny-llama/requests", params={"wait": 20},
                            json={"input": {"prompt": "Once upon a time"}, "params": {"max_new_tokens": 32}})
            assert r.status_code == 200 and r.json()["output"]["completion_tokens"] <= 32
            assert r.json()["output"]["token_ids"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, (tmp_path / "up.log").read_text()[-3000:]
    assert "batchgate up: stopped" in (tmp_path / "up.log").read_text()
    assert not (tmp_path / "state" / "up.json").exists()
