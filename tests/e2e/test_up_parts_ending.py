"""`batchgate up` when a part ends or cannot start, as a user meets it: kill -9 of the embedded redis-server stops
the stack with exit status 1 and names it; a Ctrl+C with accepted requests still queued in the embedded Redis
says how many it discards; a gateway port taken by another process is named with the part. The echo model
keeps these quick (no weights, no torch)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from shared.embedded_redis import free_port

pytestmark = [pytest.mark.slow]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "BATCHGATE_REDIS_URL")}
    env.update(BATCHGATE_STATE_DIR=str(tmp_path / "state"), BATCHGATE_LOG_FORMAT="json",
               BATCHGATE_WORKER_METRICS_PORT="0", BATCHGATE_DISPATCHER_METRICS_PORT="0",
               BATCHGATE_MODELS="echo", BATCHGATE_MODEL__ECHO__KIND="echo", BATCHGATE_MODEL__ECHO__TASK="generate",
               BATCHGATE_MODEL__ECHO__STEP_MS="200", BATCHGATE_DRAIN_BUDGET_S="1")
    return env


class Up:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path, base: str) -> None:
        self.proc, self.log, self.base = proc, log, base

    def text(self) -> str:
        return self.log.read_text()

    def wait_up(self) -> None:
        end = time.monotonic() + 120
        while "batchgate is up" not in self.text():
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < end, "batchgate up did not become ready"
            time.sleep(0.2)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:  # its own process group, as a shell gives a foreground job
        proc = subprocess.Popen([sys.executable, "-m", "batchgate", "up", "--port", str(port)], env=_env(tmp_path),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    yield Up(proc, log, f"http://127.0.0.1:{port}")
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _child(pid: int, name: str) -> int | None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if Path(f"/proc/{child}/comm").read_text().strip() == name:
                return int(child)
    return None


@pytest.mark.skipif(not shutil.which("redis-server") or not sys.platform.startswith("linux"),
                    reason="the embedded Redis is a redis-server process only where one is installed; reads /proc")
def test_kill_9_of_the_embedded_redis_stops_the_stack_with_status_1(up: Up):
    up.wait_up()
    redis_pid = _child(up.proc.pid, "redis-server")
    assert redis_pid is not None
    os.kill(redis_pid, signal.SIGKILL)
    code = up.proc.wait(timeout=60)  # it used to run on (every submit a 503) until a Ctrl+C, then exit 0
    text = up.text()
    assert code == 1, text[-3000:]
    assert "batchgate up: the embedded Redis (redis-server) was killed by SIGKILL" in text
    assert text.strip().splitlines()[-1] == "batchgate up: stopped"


def test_ctrl_c_says_how_many_accepted_requests_the_embedded_redis_discards(up: Up):
    up.wait_up()
    with httpx.Client(base_url=up.base, timeout=30) as client:
        for _ in range(3):  # 200 steps of 200 ms each: none finishes before the stop
            r = client.post("/v1/models/echo/requests",
                            json={"input": {"prompt": "abc"}, "params": {"max_new_tokens": 200}})
            assert r.status_code == 202, r.text
    os.killpg(up.proc.pid, signal.SIGINT)
    code = up.proc.wait(timeout=60)
    text = up.text()
    assert code == 0, text[-3000:]
    line = next((raw for raw in text.splitlines() if "discarded" in raw), "")
    assert line.startswith("batchgate up: 3 accepted requests were still queued and are discarded with the "
                           "embedded Redis"), text[-3000:]
    assert "REDIS_URL" in line


def test_a_taken_gateway_port_is_named_as_the_caller_gave_it_before_anything_starts(tmp_path: Path):
    """`--port` taken: one line naming the flag and the address in use, exit 2 (a configuration error), before Redis,
    the worker and its models start (a port taken later, in a race, is still named by the supervisor)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "batchgate", "up", "--port", str(port)], env=_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"--port {port}: 127.0.0.1:{port} is in use by another process" in done.stderr, done.stderr[-3000:]
    assert "redis:" not in done.stderr and "Traceback" not in done.stderr  # nothing started: no banner
