"""`batchgate up`'s life as a user lives it: Ctrl+C from a terminal (the whole foreground process group
gets SIGINT) stops it in order, quickly and quietly; SIGKILL of `up` leaves no child behind; while it
runs, the operations CLI finds its Redis by itself, and says so in one line when there is none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.embedded_redis import free_port

pytestmark = [pytest.mark.slow]


def _children(pid: int) -> set[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return set()
    return {int(c) for c in text.split()}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _env(model_cache: Path, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BATCHGATE_REDIS_URL")}
    env.update(BATCHGATE_MODEL_CACHE=str(model_cache), BATCHGATE_LOG_FORMAT="json",
               BATCHGATE_STATE_DIR=str(tmp_path / "state"), BATCHGATE_WORKER_METRICS_PORT=str(free_port()),
               BATCHGATE_DISPATCHER_METRICS_PORT=str(free_port()))
    return env


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "batchgate", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
def test_sigkill_of_up_leaves_no_child_behind(model_cache, tmp_path):
    env = _env(model_cache, tmp_path)
    env["BATCHGATE_MODELS"] = "minilm"
    proc = subprocess.Popen([sys.executable, "-m", "batchgate", "up", "--port", str(free_port())], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 60
        while len(kids := _children(proc.pid)) < 4:  # redis-server (if installed), worker, gateway, dispatcher
            assert proc.poll() is None
            if time.monotonic() > end:
                break
            time.sleep(0.1)
        assert len(kids) >= 3, kids
        time.sleep(1.0)  # past start-up of the children themselves
    finally:
        proc.kill()
        proc.wait()
    end = time.monotonic() + 5
    while (left := {k for k in kids if _alive(k)}) and time.monotonic() < end:
        time.sleep(0.1)
    for k in left:  # do not leave them behind even when the assertion fails
        os.kill(k, signal.SIGKILL)
    assert not left, f"children outlived a SIGKILLed `batchgate up`: {left}"


def test_ctrl_c_stops_in_order_quickly_and_quietly(model_cache, tmp_path):
    env = _env(model_cache, tmp_path)
    port = free_port()
    log_path = tmp_path / "up.log"
    log = log_path.open("w+")
    # its own process group, as a shell gives a foreground job: Ctrl+C is SIGINT to that whole group
    proc = subprocess.Popen([sys.executable, "-m", "batchgate", "up", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    kids: set[int] = set()
    try:
        end = time.monotonic() + 240
        while "batchgate is up" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < end, "batchgate up did not become ready"
            time.sleep(0.2)
        kids = _children(proc.pid)
        text = log_path.read_text()
        assert "(webhook dispatcher)" in text and env["BATCHGATE_DISPATCHER_METRICS_PORT"] in text
        assert "BATCHGATE_CALLBACK_ALLOW=127.0.0.1" in text
        # the operations CLI finds this stack's Redis with nothing named
        state = json.loads((tmp_path / "state" / "up.json").read_text())
        created = _cli(env, "keys", "create", "--tenant", "t1")
        assert created.returncode == 0, created.stderr
        listed = _cli(env, "keys", "list")
        assert listed.returncode == 0 and listed.stdout.startswith("t1 "), listed
        assert created.stdout.strip() not in listed.stdout  # hashes only
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            r = client.post("/v1/models/tiny-llama/requests",
                            json={"input": {"prompt": "Once upon a time"},
                                  "params": {"max_new_tokens": 200, "ignore_eos": True}})
            assert r.status_code == 202
            request_id = r.json()["id"]
        mark = len(log_path.read_text().splitlines())
        started = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=40)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    tail = log_path.read_text().splitlines()[mark:]
    noisy = [line for line in tail if '"warning"' in line or '"error"' in line or "Traceback" in line]
    assert code == 0, "\n".join(tail[-40:])
    assert took < 25, took
    assert len(noisy) <= 3, "\n".join(noisy)
    assert "batchgate up: stopped" in tail[-1]

    def at(needle: str) -> int:
        return next(i for i, line in enumerate(tail) if needle in line)

    # in order: intake stops, the worker drains and finishes the request it was running, then the rest
    finished = at(request_id)
    assert '"succeeded"' in tail[finished], tail[finished]
    assert at("Finished server process") < at("worker draining") < finished < at("worker stopped")
    assert not any(_alive(k) for k in kids)
    assert not (tmp_path / "state" / "up.json").exists()  # removed on a clean exit
    # with the stack gone, the CLI says so in one line and fails
    gone = _cli(env, "tenants", "show", "t1", "--redis-url", state["redis_url"])
    assert gone.returncode == 1 and "Traceback" not in gone.stderr
    assert len(gone.stderr.strip().splitlines()) == 1 and state["redis_url"] in gone.stderr, gone.stderr

