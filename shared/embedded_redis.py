"""The embedded Redis of `batchgate up`: a local `redis-server` on a free loopback port if one is
installed, else an in-process fakeredis served over TCP (good enough for a demo; not for production:
it models no persistence, failover or client limits)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shared.lifeline import die_with_parent
from shared.logs import get_logger

log = get_logger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EmbeddedRedis:
    url: str
    kind: str  # "redis-server" | "fakeredis"
    _proc: subprocess.Popen[bytes] | None = None
    _server: Any = None
    _dir: Any = field(default=None, repr=False)

    def poll(self) -> int | None:
        """None while it serves; else the redis-server's exit status (negative: the signal that ended it). A
        fakeredis serves from a thread of this process: it lasts as long as the process does."""
        return self._proc.poll() if self._proc is not None else None

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._dir is not None:
            self._dir.cleanup()


def _wait_for_port(host: str, port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def start_embedded_redis(host: str = "127.0.0.1") -> EmbeddedRedis:
    exe = shutil.which("redis-server")
    if exe:
        port = free_port(host)
        workdir = tempfile.TemporaryDirectory(prefix="batchgate-redis-")
        proc = subprocess.Popen(
            [exe, "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
             "--dir", workdir.name, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # its own session: a terminal's Ctrl+C must not stop Redis before the processes using it;
            # and it dies with this process rather than outliving it, orphaned
            start_new_session=True, preexec_fn=die_with_parent(),
        )
        if _wait_for_port(host, port, 10):
            log.info("embedded redis: started a local redis-server", url=f"redis://{host}:{port}/0", exe=exe)
            return EmbeddedRedis(f"redis://{host}:{port}/0", "redis-server", _proc=proc, _dir=workdir)
        proc.kill()
        workdir.cleanup()
        log.warning("embedded redis: redis-server did not start; falling back to fakeredis")
    import fakeredis

    server = fakeredis.TcpFakeServer((host, 0), server_type="redis")
    port = server.server_address[1]
    threading.Thread(target=server.serve_forever, name="fakeredis", daemon=True).start()
    log.warning("embedded redis: no redis-server on PATH; serving an in-process fakeredis over TCP "
                "(demo only: no persistence)", url=f"redis://{host}:{port}/0")
    return EmbeddedRedis(f"redis://{host}:{port}/0", "fakeredis", _server=server)
