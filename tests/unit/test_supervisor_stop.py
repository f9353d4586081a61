"""The stop order of `batchgate up` (batchgate/supervisor.py): gateway, worker, dispatcher; a part that
will not stop is killed after its time, at once on a second Ctrl+C, and the stop reports it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from batchgate.supervisor import Stack

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")


def _proc(code: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


@pytest.mark.spawns
def test_parts_stop_in_order_and_cleanly(tmp_path: Path):
    order = tmp_path / "order"
    code = ("import signal, sys, time\n"
            "def bye(*_):\n"
            f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye); print('ready', flush=True); time.sleep(60)")
    procs = {}
    for part in ("callbacks", "worker", "gateway"):  # started in another order than they stop
        p = subprocess.Popen([sys.executable, "-c", code, part], stdout=subprocess.PIPE)
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        procs[part] = p
    assert Stack(procs).stop(drain_budget_s=1.0) is True
    assert order.read_text().split() == ["gateway", "worker", "callbacks"]


@pytest.mark.spawns
def test_the_gateway_gets_its_shutdown_grace_to_stop(monkeypatch):
    """A gateway finishing its waiters within BATCHGATE_SHUTDOWN_GRACE_S is not killed for it (up gave every part
    but the worker a fixed 10 s, so a grace of 30 s was cut at 10)."""
    from batchgate import supervisor

    monkeypatch.setattr(supervisor, "STOP_MARGIN_S", 0.3)
    slow = ("import signal, sys, time\n"
            "def bye(*_):\n"
            "    time.sleep(1.5); sys.exit(0)\n"
            "signal.signal(signal.SIGTERM, bye); print('ready', flush=True); time.sleep(60)")
    assert Stack({"gateway": _proc(slow)}).stop(drain_budget_s=0.0, shutdown_grace_s=2.0) is True
    assert Stack({"gateway": _proc(slow)}).stop(drain_budget_s=5.0, shutdown_grace_s=0.5) is False  # killed


@pytest.mark.spawns
def test_a_second_signal_while_stopping_kills_at_once_and_the_stop_is_not_clean():
    stack = Stack({"worker": _proc(STUBBORN)})
    stack.signals = 1  # the first Ctrl+C, which started the stop

    def second_ctrl_c() -> None:
        time.sleep(0.5)
        stack._on_signal(2, None)

    threading.Thread(target=second_ctrl_c).start()
    started = time.monotonic()
    assert stack.stop(drain_budget_s=30.0) is False
    assert time.monotonic() - started < 5
    assert stack.procs["worker"].returncode is not None


def test_up_uses_the_documented_metrics_ports_unless_taken_or_off():
    import socket

    from batchgate.supervisor import _port_or_free
    from shared.config import Settings

    defaults = Settings.from_environ({})
    assert (defaults.worker_metrics_port, defaults.dispatcher_metrics_port) == (9464, 9465)  # as the README says
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert _port_or_free(port) != port
    assert _port_or_free(port) == port  # free again
    assert _port_or_free(0) == 0  # off stays off


def test_up_exits_1_when_a_part_had_to_be_killed_on_the_way_out(monkeypatch, tmp_path: Path):
    """The README: `batchgate up` exits 1 when a part failed or had to be killed, even when the stack ran fine
    until it was asked to stop."""
    from batchgate import supervisor
    from shared.config import Settings

    class Ran:
        stop_requested = False

        def __init__(self, clean: bool) -> None:
            self.clean = clean

        def wait_ready(self, *_: object) -> bool:
            return True

        def supervise(self) -> int:
            return 0  # stopped by a Ctrl+C

        def stop(self, drain_budget_s: float, shutdown_grace_s: float = 10.0) -> bool:
            return self.clean

    monkeypatch.setattr(supervisor, "_banner", lambda *a: None)
    monkeypatch.setattr(supervisor, "redis_problem", lambda url: None)  # no Redis here: say it answers
    env = {"BATCHGATE_REDIS_URL": "redis://127.0.0.1:1/0", "BATCHGATE_STATE_DIR": str(tmp_path)}
    for clean, code in ((True, 0), (False, 1)):
        monkeypatch.setattr(supervisor.Stack, "start", staticmethod(lambda env, watched=None, c=clean: Ran(c)))
        assert supervisor.run_stack(Settings(port=1), env) == code


def test_up_with_a_redis_it_cannot_reach_says_so_and_starts_nothing(monkeypatch, tmp_path: Path, capsys):
    """`batchgate up --redis-url` at a port where nothing listens: one line naming the Redis, exit 1, no parts
    started (they would only print tracebacks and then `the stack did not become ready`)."""
    from batchgate import supervisor
    from shared.config import Settings
    from shared.embedded_redis import free_port

    def never(env: object) -> None:
        raise AssertionError("the parts were started")

    monkeypatch.setattr(supervisor.Stack, "start", staticmethod(never))
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {"BATCHGATE_REDIS_URL": url, "BATCHGATE_STATE_DIR": str(tmp_path)}
    assert supervisor.run_stack(Settings(port=1), env) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"batchgate up: cannot reach Redis at {url} ("), err


def test_the_banner_shows_examples_for_the_models_served_only(capsys):
    from batchgate.supervisor import _banner
    from shared.config import Settings

    env = {"BATCHGATE_WORKER_METRICS_PORT": "0", "BATCHGATE_DISPATCHER_METRICS_PORT": "0"}
    settings = Settings.from_environ({"BATCHGATE_MODELS": "bench-llama,my-embed",
                                      "BATCHGATE_MODEL__MY_EMBED__SOURCE": "builtin:minilm",
                                      "BATCHGATE_MODEL__MY_EMBED__TASK": "embed"})
    _banner("http://127.0.0.1:1", "redis://x", "external", env, settings)
    out = capsys.readouterr().out
    assert "/v1/models/bench-llama/requests" in out and "/v1/models/my-embed/requests" in out
    assert "minilm/" not in out and "tiny-llama" not in out
    only_generate = Settings.from_environ({"BATCHGATE_MODELS": "bench-llama"})
    _banner("http://127.0.0.1:1", "redis://x", "external", env, only_generate)
    out = capsys.readouterr().out
    assert "/v1/models/bench-llama/requests" in out and "texts" not in out  # no embedding model: no embed example


# --- a part that ends is named, the embedded Redis included; what the embedded Redis discards is said ----------

SLEEPER = "import time; print('ready', flush=True); time.sleep(60)"


class FakeEmbedded:
    """The embedded Redis as `run_stack` sees it: a URL, a kind, whether it still runs, a stop."""

    def __init__(self, status: int | None = None) -> None:
        self.url, self.kind, self.status, self.stopped = "redis://127.0.0.1:1/0", "redis-server", status, False

    def poll(self) -> int | None:
        return self.status

    def stop(self) -> None:
        self.stopped = True


def _exited(code: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code])
    p.wait()
    return p


@pytest.mark.spawns
def test_a_part_that_ends_is_named_with_its_exit_status_or_signal(capsys):
    from batchgate.supervisor import ended

    assert ended("worker", -9) == "the worker was killed by SIGKILL"
    assert ended("gateway", 1) == "the gateway exited with status 1"
    assert ended("redis", -9) == "the embedded Redis (redis-server) was killed by SIGKILL"
    assert "callbacks" in ended("callbacks", 0) and "batches" in ended("batches", 2)
    running = _proc(SLEEPER)
    try:
        stack = Stack({"gateway": running, "worker": _exited("import os, signal; os.kill(os.getpid(), 9)")})
        assert stack.supervise() == 1
    finally:
        running.kill()
        running.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["batchgate up: the worker was killed by SIGKILL; stopping the stack"], err


@pytest.mark.spawns
def test_the_embedded_redis_ending_stops_the_stack_like_any_part(capsys):
    """kill -9 of the embedded redis-server: `up` stops the stack (it used to run on, every submit a 503)."""
    from shared.config import Settings

    running = _proc(SLEEPER)
    try:
        stack = Stack({"worker": running}, watched={"redis": lambda: -9})
        started = time.monotonic()
        assert stack.wait_ready("http://127.0.0.1:1", "redis://127.0.0.1:1/0", Settings()) is False
        assert time.monotonic() - started < 5  # not the start-up timeout
        assert stack.supervise() == 1
    finally:
        running.kill()
        running.wait()
    err = capsys.readouterr().err
    assert "the embedded Redis (redis-server) was killed by SIGKILL" in err and "stopping the stack" in err


def _run_with_embedded(monkeypatch, tmp_path: Path, embedded: FakeEmbedded, stack: object) -> int:
    from batchgate import supervisor
    from shared.config import Settings

    monkeypatch.setattr(supervisor, "_banner", lambda *a: None)
    monkeypatch.setattr(supervisor, "start_embedded_redis", lambda: embedded)
    monkeypatch.setattr(supervisor.Stack, "start", staticmethod(lambda env, watched=None: stack))
    return supervisor.run_stack(Settings(port=1), {"BATCHGATE_STATE_DIR": str(tmp_path)})


@pytest.mark.spawns
def test_up_exits_1_naming_the_embedded_redis_when_it_dies_while_running(monkeypatch, tmp_path: Path, capsys):
    embedded = FakeEmbedded()
    running = _proc(SLEEPER)
    stack = Stack({"worker": running}, watched={"redis": embedded.poll})
    monkeypatch.setattr(stack, "wait_ready", lambda *a: True)
    embedded.status = -9  # kill -9 of the redis-server once the stack is up
    assert _run_with_embedded(monkeypatch, tmp_path, embedded, stack) == 1
    assert running.returncode is not None and embedded.stopped
    err = capsys.readouterr().err
    assert err.count("embedded Redis (redis-server) was killed by SIGKILL") == 1, err  # said once
    assert err.strip().splitlines()[-1] == "batchgate up: stopped"


def test_up_exits_1_when_the_embedded_redis_died_before_a_ctrl_c(monkeypatch, tmp_path: Path, capsys):
    """A Redis found dead only on the way out (the stack was asked to stop) still makes the exit status 1."""

    class AskedToStop:
        stop_requested = False

        def wait_ready(self, *_: object) -> bool:
            return True

        def supervise(self) -> int:
            return 0

        def stop(self, drain_budget_s: float, shutdown_grace_s: float = 10.0) -> bool:
            return True

    assert _run_with_embedded(monkeypatch, tmp_path, FakeEmbedded(status=-9), AskedToStop()) == 1
    assert "embedded Redis (redis-server) was killed by SIGKILL" in capsys.readouterr().err


@pytest.mark.parametrize("states, batches, says", [
    (["queued", "running", "succeeded", "cancelled"], 0, ["2 accepted requests were still queued and are discarded"]),
    (["queued", "failed"], 0, ["1 accepted request was still queued and is discarded"]),
    (["succeeded"], 0, []),
    (["queued"], 2, ["1 accepted request was still queued and is discarded", "2 batches not finished are discarded"]),
    (["succeeded"], 1, ["1 batch not finished is discarded"]),  # a batch whose lines wait to be fed: none queued
])
def test_stopping_with_the_embedded_redis_says_how_many_accepted_requests_it_discards(
        states, batches, says, monkeypatch, tmp_path: Path, capsys):
    import fakeredis

    from shared.keys import Keys

    server = fakeredis.FakeServer()
    monkeypatch.setattr("shared.redis_io.make_sync_redis", lambda url, **_: fakeredis.FakeRedis(server=server))
    client = fakeredis.FakeRedis(server=server)
    for i, state in enumerate(states):
        client.hset(Keys("bg").record(f"req_{i}"), "state", state)
    client.hset(Keys("other").record("req_x"), "state", "queued")  # another prefix: not this stack's
    for i in range(batches):
        client.zadd(Keys("bg").batches_active(), {f"batch_{i}": i})
    client.zadd(Keys("other").batches_active(), {"batch_x": 0})

    class CtrlC:
        stop_requested = False

        def wait_ready(self, *_: object) -> bool:
            return True

        def supervise(self) -> int:
            return 0

        def stop(self, drain_budget_s: float, shutdown_grace_s: float = 10.0) -> bool:
            return True

    embedded = FakeEmbedded()
    assert _run_with_embedded(monkeypatch, tmp_path, embedded, CtrlC()) == 0
    err = capsys.readouterr().err
    assert embedded.stopped
    lines = [raw for raw in err.splitlines() if "discarded" in raw]
    assert len(lines) == len(says), err
    for line, said in zip(lines, says, strict=True):
        assert said in line and "with the embedded Redis" in line and "REDIS_URL" in line, line


@pytest.mark.parametrize("environ", [{}, {"BATCHGATE_FILES_DIR": "mine"}, {"BATCHGATE_FILES_S3_BUCKET": "b"}])
def test_uploaded_files_go_with_the_embedded_redis_that_holds_their_records(monkeypatch, tmp_path: Path, environ):
    """Under `up` with its embedded Redis, uploaded files and batch outputs live in a directory of the stack's own,
    removed when it stops: their records go with the Redis, and the bytes stayed on disk, unlisted and undeletable
    (18 MB after one session). A files directory or bucket the user names is theirs, untouched."""
    from batchgate import supervisor
    from shared.config import Settings

    seen: dict[str, str] = {}

    class Running:
        stop_requested = False

        def wait_ready(self, *_: object) -> bool:
            return True

        def supervise(self) -> int:
            assert seen["dir"] and Path(seen["dir"]).is_dir(), seen  # (never the working directory: "" is ".")
            (Path(seen["dir"]) / "file-x").write_bytes(b"uploaded")  # what the gateway writes meanwhile
            return 0

        def stop(self, drain_budget_s: float, shutdown_grace_s: float = 10.0) -> bool:
            return True

    def start(env, watched=None):
        seen["dir"] = env.get("BATCHGATE_FILES_DIR", "")
        return Running()

    monkeypatch.setattr(supervisor, "_banner", lambda *a: None)
    monkeypatch.setattr(supervisor, "start_embedded_redis", lambda: FakeEmbedded())
    monkeypatch.setattr(supervisor, "unfinished_work", lambda *a: (0, 0))
    monkeypatch.setattr(supervisor.Stack, "start", staticmethod(start))
    if environ:
        monkeypatch.setattr(Running, "supervise", lambda self: 0)
    assert supervisor.run_stack(Settings(port=1), {"BATCHGATE_STATE_DIR": str(tmp_path), **environ}) == 0
    if environ:
        assert seen["dir"] == environ.get("BATCHGATE_FILES_DIR", "")  # the user's, as given (or none: S3)
    else:
        assert Path(seen["dir"]).name.startswith("batchgate-up-files-") and not Path(seen["dir"]).exists()


@pytest.mark.spawns
def test_a_gateway_that_cannot_bind_its_port_is_named_with_why(monkeypatch, tmp_path: Path, capsys):
    """Not only `the stack did not become ready`: which part, how it ended, and that its port is taken."""
    import socket

    from batchgate import supervisor
    from shared.config import Settings

    monkeypatch.setattr(supervisor, "redis_problem", lambda url: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        running = _proc(SLEEPER)
        stack = Stack({"worker": running, "gateway": _exited("import sys; sys.exit(1)")})
        monkeypatch.setattr(supervisor.Stack, "start", staticmethod(lambda env, watched=None: stack))
        env = {"BATCHGATE_REDIS_URL": "redis://127.0.0.1:1/0", "BATCHGATE_STATE_DIR": str(tmp_path)}
        assert supervisor.run_stack(Settings(port=port), env) == 1
    assert running.returncode is not None
    line = next(raw for raw in capsys.readouterr().err.splitlines() if "did not become ready" in raw)
    assert "the gateway exited with status 1" in line and f"127.0.0.1:{port} is in use" in line, line
    assert "--port" in line
