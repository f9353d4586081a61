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


def cmd_callbacks(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging(settings.log_level, settings.log_format)
    import asyncio
    import signal as sig

    from prometheus_client import start_http_server

    from gateway.dispatcher import Dispatcher

    port = int(os.environ.get("BATCHGATE_DISPATCHER_METRICS_PORT", "9465"))
    if port:
        start_http_server(port, addr="127.0.0.1")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for s in (sig.SIGTERM, sig.SIGINT):
            loop.add_signal_handler(s, stop.set)
        await Dispatcher(settings, default_secret=os.environ.get("BATCHGATE_WEBHOOK_SECRET", "")).run(stop)

    asyncio.run(main())
    return 0


def cmd_webhooks(args: argparse.Namespace) -> int:
    """Show, rotate or retire a tenant's webhook signing secret."""
    import asyncio

    from shared.keys import Keys
    from shared.redis_io import make_redis
    from shared.tenants import TenantStore

    settings = _settings(args)

    async def main() -> None:
        redis = make_redis(settings.redis_url)
        store = TenantStore(redis, Keys(settings.key_prefix))
        if args.action == "rotate":
            print(await store.rotate_webhook_secret(args.tenant))
        elif args.action == "drop-old":
            await store.drop_old_webhook_secrets(args.tenant)
        elif args.action == "thin":
            await store.set(args.tenant, thin_callbacks=args.value == "on")
        secrets = await store.webhook_secrets(args.tenant)
        print("\n".join(f"{'signing' if i == 0 else 'also accepted'}: {s}" for i, s in enumerate(secrets)))
        await redis.aclose()

    asyncio.run(main())
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    """Create, revoke or list API keys (stored hashed: a new key is printed once, never again)."""
    import asyncio

    from shared.keys import Keys
    from shared.redis_io import make_redis
    from shared.tenants import TenantStore

    settings = _settings(args)

    async def main() -> int:
        redis = make_redis(settings.redis_url)
        store = TenantStore(redis, Keys(settings.key_prefix))
        try:
            if args.action == "create":
                print(await store.create_key(args.tenant))
            elif args.action == "revoke":
                tenant = await store.revoke_key(args.key)
                if tenant is None:
                    print("no such key", file=sys.stderr)
                    return 1
                print(f"revoked a key of tenant {tenant}")
            else:
                for digest in await store.list_keys(args.tenant):
                    print(digest)
            return 0
        finally:
            await redis.aclose()

    return asyncio.run(main())


def cmd_tenants(args: argparse.Namespace) -> int:
    """Per-tenant limits: submit rate, burst, backlog quota, thin webhook payloads."""
    import asyncio

    from shared.keys import Keys
    from shared.redis_io import make_redis
    from shared.tenants import TenantStore

    settings = _settings(args)

    async def main() -> None:
        redis = make_redis(settings.redis_url)
        store = TenantStore(redis, Keys(settings.key_prefix))
        if args.action == "set":
            fields: dict[str, float | int | bool | None] = {}
            if args.rate is not None:
                fields["rate_per_s"] = args.rate
            if args.burst is not None:
                fields["burst"] = args.burst
            if args.max_backlog is not None:
                fields["max_backlog"] = args.max_backlog
            if args.thin_callbacks is not None:
                fields["thin_callbacks"] = args.thin_callbacks == "on"
            await store.set(args.tenant, **fields)
        cfg = await store.get(args.tenant)
        print(json.dumps({"tenant": cfg.name, "rate_per_s": cfg.rate_per_s, "burst": cfg.burst,
                          "max_backlog": cfg.max_backlog, "thin_callbacks": cfg.thin_callbacks,
                          "webhook_secrets": len(cfg.webhook_secrets)}))
        await redis.aclose()

    asyncio.run(main())
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
    env.setdefault("BATCHGATE_AUTH", "off")  # local use; the gateway logs it loudly
    if args.config:
        env["BATCHGATE_CONFIG"] = args.config
    cli = [sys.executable, "-m", "shared.cli"]
    env.setdefault("BATCHGATE_DISPATCHER_METRICS_PORT", str(free_port()))
    stack = _Stack({"worker": subprocess.Popen([*cli, "worker"], env=env),
                    "gateway": subprocess.Popen([*cli, "gateway"], env=env),
                    "callbacks": subprocess.Popen([*cli, "callbacks"], env=env)})
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
        "  auth:    " + ("OFF (local use: every caller is tenant default)" if env.get("BATCHGATE_AUTH") == "off"
                         else "API keys (batchgate keys create --tenant NAME)"),
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

    up = sub.add_parser("up", help="run Redis (embedded unless REDIS_URL is set), a gateway, a worker and a "
                                   "webhook dispatcher")
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

    cb = sub.add_parser("callbacks", help="run a webhook dispatcher (several may run)")
    common(cb)
    cb.set_defaults(func=cmd_callbacks)

    wh = sub.add_parser("webhooks", help="show or rotate a tenant's webhook signing secret")
    common(wh)
    wh.add_argument("action", choices=["show", "rotate", "drop-old", "thin"],
                    help="show the secrets; rotate (sign with a new one, keep accepting the old); drop-old "
                         "(end the overlap); thin on|off (payloads with ids only)")
    wh.add_argument("value", nargs="?", choices=["on", "off"], help="for `thin`")
    wh.add_argument("--tenant", default="default")
    wh.set_defaults(func=cmd_webhooks)

    ks = sub.add_parser("keys", help="create, revoke or list API keys")
    common(ks)
    ks.add_argument("action", choices=["create", "revoke", "list"])
    ks.add_argument("key", nargs="?", help="for revoke: the key, or its hash as `list` shows it")
    ks.add_argument("--tenant", default="default")
    ks.set_defaults(func=cmd_keys)

    ts = sub.add_parser("tenants", help="show or set a tenant's limits")
    common(ts)
    ts.add_argument("action", choices=["show", "set"])
    ts.add_argument("tenant")
    ts.add_argument("--rate", type=float, help="submits per second (token bucket)")
    ts.add_argument("--burst", type=int, help="bucket size")
    ts.add_argument("--max-backlog", type=int, help="requests queued or running at once")
    ts.add_argument("--thin-callbacks", choices=["on", "off"])
    ts.set_defaults(func=cmd_tenants)
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
