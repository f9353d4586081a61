"""The stop order of `batchgate up` (batchgate/supervisor.py): gateway, worker, dispatcher; a part that
will not stop is killed after its time, at once on a second Ctrl+C, and the stop reports it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from batchgate.supervisor import Stack

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
            "time.sleep(60)")


def _proc(code: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


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

        def stop(self, drain_budget_s: float) -> bool:
            return self.clean

    monkeypatch.setattr(supervisor, "_banner", lambda *a: None)
    monkeypatch.setattr(supervisor, "redis_problem", lambda url: None)  # no Redis here: say it answers
    env = {"BATCHGATE_REDIS_URL": "redis://127.0.0.1:1/0", "BATCHGATE_STATE_DIR": str(tmp_path)}
    for clean, code in ((True, 0), (False, 1)):
        monkeypatch.setattr(supervisor.Stack, "start", staticmethod(lambda env, c=clean: Ran(c)))
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
