"""`batchgate up`: Redis (embedded unless one is named), a gateway, a worker and a webhook dispatcher as
child processes; ready when the gateway answers /readyz and a worker has announced every model; stops
them all on a signal or when one of them exits.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping

from shared.config import Settings, redis_url_from
from shared.embedded_redis import free_port, start_embedded_redis

STARTUP_TIMEOUT_S = 600.0


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _workers_up(redis_url: str, prefix: str, models: set[str]) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(redis_url, socket_timeout=1.0)
        seen: set[str] = set()
        for raw in client.hvals(f"{prefix}:workers"):
            seen.update(json.loads(raw).get("models", []))
        client.close()
        return models <= seen
    except (redis.RedisError, OSError, ValueError):
        return False


class Stack:
    """The processes `batchgate up` supervises."""

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.stop_requested = False

    @classmethod
    def start(cls, env: Mapping[str, str]) -> Stack:
        """A worker, a gateway and a dispatcher, each `python -m batchgate <part>`; SIGINT/SIGTERM ask it to stop."""
        cli = [sys.executable, "-m", "batchgate"]
        parts = ("worker", "gateway", "callbacks")
        stack = cls({part: subprocess.Popen([*cli, part], env=dict(env)) for part in parts})
        signal.signal(signal.SIGINT, stack._on_signal)
        signal.signal(signal.SIGTERM, stack._on_signal)
        return stack

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    def exited(self) -> bool:
        return any(p.poll() is not None for p in self.procs.values())

    def wait_ready(self, base: str, redis_url: str, settings: Settings) -> bool:
        end = time.monotonic() + STARTUP_TIMEOUT_S
        models = {m.name for m in settings.models}
        while not self.stop_requested and not self.exited() and time.monotonic() < end:
            if _http_ok(base + "/readyz") and _workers_up(redis_url, settings.key_prefix, models):
                return True
            time.sleep(0.2)
        return False

    def supervise(self) -> int:
        """Run until a signal (exit 0) or until a process dies (exit 1)."""
        while not self.stop_requested:
            if self.exited():
                print("batchgate up: a process exited; stopping the stack", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=45)
            except subprocess.TimeoutExpired:
                p.kill()


def run_stack(settings: Settings, environ: Mapping[str, str]) -> int:
    """Start the stack from `environ` (the caller's, with its command-line overrides) and supervise it."""
    embedded = None
    redis_url = redis_url_from(environ)
    if not redis_url:
        embedded = start_embedded_redis()
        redis_url = embedded.url
    port = settings.port or free_port()
    env = {**environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_HOST": settings.host,
           "BATCHGATE_PORT": str(port), "BATCHGATE_MODELS": ",".join(m.name for m in settings.models)}
    env.setdefault("BATCHGATE_WORKER_METRICS_PORT", str(free_port()))
    env.setdefault("BATCHGATE_AUTH", "off")  # local use; the gateway logs it loudly
    env.setdefault("BATCHGATE_DISPATCHER_METRICS_PORT", str(free_port()))
    stack = Stack.start(env)
    base = f"http://{settings.host}:{port}"
    try:
        if not stack.wait_ready(base, redis_url, settings):
            if stack.stop_requested:
                return 0
            print("batchgate up: the stack did not become ready", file=sys.stderr)
            return 1
        _banner(base, redis_url, embedded.kind if embedded else "external", env, settings)
        return stack.supervise()
    finally:
        stack.stop()
        if embedded is not None:
            embedded.stop()
        print("batchgate up: stopped", file=sys.stderr, flush=True)


def _banner(base: str, redis_url: str, redis_kind: str, env: Mapping[str, str], settings: Settings) -> None:
    lines = [
        f"batchgate is up: {base}",
        f"  redis:   {redis_url} ({redis_kind})",
        f"  models:  {', '.join(m.name + ' (' + m.task.value + ')' for m in settings.models)}",
        f"  metrics: {base}/metrics (gateway), "
        f"http://127.0.0.1:{env['BATCHGATE_WORKER_METRICS_PORT']}/metrics (worker)",
        "  try:",
        f"    curl -s -X POST '{base}/v1/models/minilm/requests?wait=5' -H 'content-type: application/json' "
        "-d '{\"input\": {\"texts\": [\"hello\"]}}'",
        f"    curl -s -X POST '{base}/v1/models/tiny-llama/requests?wait=10' -H 'content-type: application/json' "
        "-d '{\"input\": {\"prompt\": \"Once upon a time\"}, \"params\": {\"max_new_tokens\": 32}}'",
        "  auth:    " + ("OFF (local use: every caller is tenant default)" if env.get("BATCHGATE_AUTH") == "off"
                         else "API keys (batchgate keys create --tenant NAME)"),
        "  Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)
