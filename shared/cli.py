"""The `batchgate` command: `up` (the whole stack locally), `gateway`, `worker`.

Heavy modules (torch, uvicorn) are imported inside the subcommand that needs them, so `batchgate
gateway` never loads torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from shared.config import Settings
from shared.errors import ConfigError
from shared.logs import configure_logging

STARTUP_TIMEOUT_S = 600.0


def _settings(args: argparse.Namespace) -> Settings:
    env = dict(os.environ)
    if getattr(args, "config", None):
        env["BATCHGATE_CONFIG"] = args.config
    if getattr(args, "models", None):
        env["BATCHGATE_MODELS"] = args.models
    if getattr(args, "redis_url", None):
        env["BATCHGATE_REDIS_URL"] = args.redis_url
    if getattr(args, "host", None):
        env["BATCHGATE_HOST"] = args.host
    if getattr(args, "port", None) is not None:
        env["BATCHGATE_PORT"] = str(args.port)
    return Settings.from_environ(env)


def cmd_gateway(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging(settings.log_level, settings.log_format)
    from gateway.server import run_gateway

    run_gateway(settings)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging(settings.log_level, settings.log_format)
    from gpu_worker.main import run_worker

    run_worker(settings, drain_budget_s=args.drain_budget)
    return 0


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


class _Stack:
    """The processes `batchgate up` supervises."""

    def __init__(self, procs: dict[str, subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.stop_requested = False
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

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


def cmd_up(args: argparse.Namespace) -> int:
    from shared.embedded_redis import free_port, start_embedded_redis

    settings = _settings(args)
    configure_logging(settings.log_level, settings.log_format)
    embedded = None
    redis_url = args.redis_url or os.environ.get("BATCHGATE_REDIS_URL") or os.environ.get("REDIS_URL")
    if not redis_url:
        embedded = start_embedded_redis()
        redis_url = embedded.url
    port = settings.port or free_port()
    env = {**os.environ, "BATCHGATE_REDIS_URL": redis_url, "BATCHGATE_HOST": settings.host,
           "BATCHGATE_PORT": str(port), "BATCHGATE_MODELS": ",".join(m.name for m in settings.models)}
    env.setdefault("BATCHGATE_WORKER_METRICS_PORT", str(free_port()))
    if args.config:
        env["BATCHGATE_CONFIG"] = args.config
    cli = [sys.executable, "-m", "shared.cli"]
    stack = _Stack({"worker": subprocess.Popen([*cli, "worker"], env=env),
                    "gateway": subprocess.Popen([*cli, "gateway"], env=env)})
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


def _banner(base: str, redis_url: str, redis_kind: str, env: dict[str, str], settings: Settings) -> None:
    lines = [
        f"batchgate is up: {base}",
        f"  redis:   {redis_url} ({redis_kind})",
        f"  models:  {', '.join(m.name + ' (' + m.task.value + ')' for m in settings.models)}",
        f"  metrics: {base}/metrics (gateway), "
        f"http://127.0.0.1:{env['BATCHGATE_WORKER_METRICS_PORT']}/metrics (worker)",
        "  try:",
        f"    curl -s -X POST '{base}/v1/models/minilm/requests?wait=5' -d '{{\"input\": {{\"texts\": [\"hello\"]}}}}'",
        f"    curl -s -X POST '{base}/v1/models/tiny-llama/requests?wait=10' "
        "-d '{\"input\": {\"prompt\": \"Once upon a time\"}, \"params\": {\"max_new_tokens\": 32}}'",
        "  Ctrl-C stops everything.",
    ]
    print("\n".join(lines), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help="YAML or TOML model config (else BATCHGATE_CONFIG, else built-ins)")
        p.add_argument("--models", help="comma-separated model names to serve (else BATCHGATE_MODELS)")
        p.add_argument("--redis-url", help="Redis URL (else BATCHGATE_REDIS_URL or REDIS_URL)")

    up = sub.add_parser("up", help="run Redis (embedded unless REDIS_URL is set), a gateway and a worker")
    common(up)
    up.add_argument("--host", help="gateway bind address (default 127.0.0.1)")
    up.add_argument("--port", type=int, help="gateway port (default 8000; 0 picks a free one)")
    up.set_defaults(func=cmd_up)

    gw = sub.add_parser("gateway", help="run the HTTP gateway")
    common(gw)
    gw.add_argument("--host", help="bind address (default 127.0.0.1)")
    gw.add_argument("--port", type=int, help="port (default 8000)")
    gw.set_defaults(func=cmd_gateway)

    wk = sub.add_parser("worker", help="run a GPU worker for the configured models")
    common(wk)
    wk.add_argument("--drain-budget", type=float, default=None,
                    help="seconds to finish in-flight work on SIGTERM before handing it back "
                         "(default: BATCHGATE_DRAIN_BUDGET_S, 30)")
    wk.set_defaults(func=cmd_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"batchgate: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
