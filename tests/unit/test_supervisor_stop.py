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
