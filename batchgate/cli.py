"""The `batchgate` command: run the stack or one of its parts; manage keys, tenants and webhooks.

Parts: `up` (the whole stack locally, see batchgate/supervisor.py), `gateway`, `worker`, `callbacks`
(the webhook dispatcher), `batches` (the Batch API's runner); admin: `keys`, `tenants`, `webhooks`.

Heavy modules (torch, uvicorn) are imported inside the subcommand that needs them, so `batchgate
gateway` never loads torch. The process environment is read here once, with the command line's
overrides laid over it, and handed to `Settings.from_environ`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from shared.config import Settings, shown_url
from shared.config_checks import Rule
from shared.errors import ConfigError
from shared.logs import configure_logging


def _environ(args: argparse.Namespace) -> dict[str, str]:
    """The process environment with the command line's options laid over it."""
    from shared.config import redis_url_problem

    env = dict(os.environ)
    problem = redis_url_problem(args.redis_url) if getattr(args, "redis_url", None) else None
    if problem:
        raise ConfigError(f"--redis-url {shown_url(args.redis_url)!r} is not a Redis URL: {problem}")
    if problem := _option_problem(args):
        raise ConfigError(problem)
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
    return env


def _option_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with a serving command's --port or --drain-budget, or None (the environment's own values
    are Settings.from_environ's to check)."""
    port = getattr(args, "port", None)
    if port is not None:
        low = 0 if args.command == "up" else 1  # only `up` picks a free port for 0
        if not low <= port <= 65535:
            free = "; 0 picks a free port" if low == 0 else ""
            return f"--port must be between {low} and 65535 (got {port}){free}"
    budget = getattr(args, "drain_budget", None)
    if budget is not None and (problem := Rule(0).problem(budget)):
        return f"--drain-budget (seconds to finish the work in flight on SIGTERM) {problem}"
    return None


def _port_setting(args: argparse.Namespace) -> str:
    return "--port" if getattr(args, "port", None) is not None else "BATCHGATE_PORT"


def _check_listen(settings: Settings, args: argparse.Namespace) -> None:
    """Before a part that listens starts: its host and port are ones it can listen on (ConfigErrors)."""
    from shared.startup_checks import check_listen, host_problem

    if problem := host_problem(settings.host):
        raise ConfigError(f"{'--host' if getattr(args, 'host', None) else 'BATCHGATE_HOST'}: {problem}")
    if settings.port == 0:
        raise ConfigError(f"{_port_setting(args)} must be between 1 and 65535 for `batchgate {args.command}` "
                          "(got 0); only `batchgate up` picks a free port for 0")
    check_listen(_port_setting(args), settings.host, settings.port,
                 hint="choose another port (--port or BATCHGATE_PORT)",
                 host_setting="--host" if getattr(args, "host", None) else "BATCHGATE_HOST")


def _check_file_store(settings: Settings) -> None:
    """Before a part that keeps files (the gateway, the batch runner, `up`) starts: the files directory is one it
    can write (a ConfigError), not 503s at request time."""
    from shared.startup_checks import check_file_store

    check_file_store(settings)


def _settings(args: argparse.Namespace) -> Settings:
    return Settings.from_environ(_environ(args))


def _admin_settings(args: argparse.Namespace) -> Settings:
    """Settings for `keys`, `tenants`, `webhooks`: with no Redis named (`--redis-url`, BATCHGATE_REDIS_URL,
    REDIS_URL), the Redis and key prefix of the running `batchgate up` (batchgate/state.py); with its Redis named,
    its key prefix (unless one is set): the keys and limits then land where that stack looks."""
    from batchgate.state import is_running, recorded_state, state_path
    from shared.config import redis_url_from

    env = _environ(args)
    state = recorded_state(env)
    if (named := redis_url_from(env)) and state is not None:
        if same_redis(named, str(state.get("redis_url", ""))) and "BATCHGATE_KEY_PREFIX" not in env \
                and state.get("key_prefix"):
            env["BATCHGATE_KEY_PREFIX"] = str(state["key_prefix"])
    elif not named and state is not None:
        if not is_running(state) and state.get("redis") != "external":  # an `up` killed outright left its file:
            # its embedded Redis went with it, and writing to another one (the default) would put the keys or
            # limits where that stack, started again, never looks
            raise RedisUnreachable(
                f"batchgate: the `batchgate up` recorded in {state_path(env)} (pid {state.get('pid')}) is not "
                "running, and its embedded Redis went with it: start it again, or name the Redis to use "
                "(--redis-url, BATCHGATE_REDIS_URL or REDIS_URL); deleting that file makes these commands use the "
                "default one")
        if not is_running(state):  # its Redis was the user's own, which outlives it: still where its data is
            print(f"batchgate: the `batchgate up` recorded in {state_path(env)} (pid {state.get('pid')}) is not "
                  f"running; using the Redis it ran on, {shown_url(state['redis_url'])}", file=sys.stderr)
        env["BATCHGATE_REDIS_URL"] = str(state["redis_url"])
        if "BATCHGATE_KEY_PREFIX" not in env and state.get("key_prefix"):
            env["BATCHGATE_KEY_PREFIX"] = str(state["key_prefix"])
    return Settings.from_environ(env)


def same_redis(a: str, b: str) -> bool:
    """Whether two Redis URLs name one server and database (`localhost` is 127.0.0.1; the default port, db 0), as
    redis-py reads them."""
    from redis.connection import parse_url

    def where(url: str) -> tuple[object, object, object] | None:
        try:
            u = parse_url(url)
        except ValueError:
            return None
        host = u.get("host")
        return "127.0.0.1" if host in ("localhost", "::1") else host, u.get("port", 6379), u.get("db", 0)

    return (w := where(a)) is not None and w == where(b)


class RedisUnreachable(Exception):
    pass


def _run_admin(settings: Settings, coro_fn: Callable[[], Coroutine[Any, Any, int | None]]) -> int:
    """Run an admin command; an unreachable Redis, or a server that is not Redis, is one clear line and exit
    status 1, not a traceback."""
    import asyncio

    import redis.exceptions

    url = shown_url(settings.redis_url)  # never its password
    try:
        return int(asyncio.run(coro_fn()) or 0)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
        raise RedisUnreachable(
            f"batchgate: cannot reach Redis at {url} ({type(exc).__name__}); is `batchgate up` "
            "running? Otherwise name the Redis with --redis-url or BATCHGATE_REDIS_URL") from None
    except redis.exceptions.InvalidResponse as exc:
        raise RedisUnreachable(f"batchgate: the server at {url} does not answer as Redis does "
                               f"({_one_line(exc)}); is that the Redis URL?") from None
    except redis.exceptions.RedisError as exc:
        raise RedisUnreachable(f"batchgate: Redis at {url} refused: "
                               f"{type(exc).__name__}: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with an operations command's tenant name or limit values (checked before any Redis is
    touched: a usage error, exit status 2), or None."""
    from shared.tenants import tenant_name_problem

    tenant = getattr(args, "tenant", None)
    if tenant is not None and (problem := tenant_name_problem(tenant)):
        return problem
    rate = getattr(args, "rate", None)
    if rate is not None and not (math.isfinite(rate) and rate >= 0):
        return f"--rate must be a finite number of submits per second, >= 0 (0: no rate limit); got {rate:g}"
    burst = getattr(args, "burst", None)
    if burst is not None and burst < 1:
        return f"--burst must be a whole number >= 1; got {burst}"
    backlog = getattr(args, "max_backlog", None)
    if backlog is not None and backlog < 0:
        return f"--max-backlog must be a whole number >= 0 (0: no quota); got {backlog}"
    return None


def _finite(value: float | None) -> float | None:
    """A stored limit as JSON can carry it: one that is not a finite number (written before such values were
    refused) reads as unset."""
    return value if value is None or math.isfinite(value) else None


def cmd_gateway(args: argparse.Namespace) -> int:
    from shared.startup_checks import check_tokenizers

    settings = _settings(args)
    _check_listen(settings, args)
    _check_file_store(settings)
    check_tokenizers(settings)
    configure_logging(settings.log_level, settings.log_format)
    from gateway.server import run_gateway

    run_gateway(settings)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from shared.startup_checks import check_model_cache

    settings = _settings(args)
    check_model_cache(settings)  # a one-line error naming the setting, not the model loader's traceback
    configure_logging(settings.log_level, settings.log_format)
    from gpu_worker.main import quick_exit, run_worker

    run_worker(settings, drain_budget_s=args.drain_budget)
    quick_exit(0)


def cmd_callbacks(args: argparse.Namespace) -> int:
    settings = _settings(args)
    configure_logging(settings.log_level, settings.log_format)
    from gateway.dispatcher import run

    run(settings)
    return 0


def cmd_batches(args: argparse.Namespace) -> int:
    settings = _settings(args)
    _check_file_store(settings)
    configure_logging(settings.log_level, settings.log_format)
    from gateway.batch_runner import run

    run(settings)
    return 0


async def _warn_if_keyless(settings: Settings, store: Any, tenant: str) -> None:
    """A line on stderr where a tenant's settings or secrets are set or shown but it has no API key: a tenant is
    its keys, so a mistyped name was taken in silence. (The settings do apply to calls made as it without a key: a
    gateway with auth off, as under `up`, the SDK's direct mode, Lambda direct and SQS invocations.)"""
    if settings.auth == "api_key" and not await store.list_keys(tenant):
        print(f"batchgate: tenant {tenant!r} has no API keys yet (a typo?): no caller with a key is this tenant "
              f"(batchgate keys create --tenant {tenant}); what is set for it applies to calls made as it without "
              "one (a gateway with auth off, the SDK's direct mode, Lambda direct and SQS invocations)",
              file=sys.stderr)


def cmd_webhooks(args: argparse.Namespace) -> int:
    """Show, rotate or retire a tenant's webhook signing secret; `thin on|off` prints no secret."""
    from shared.keys import Keys
    from shared.redis_io import make_redis
    from shared.tenants import DefaultSecretUnknown, TenantStore

    if args.action == "thin" and args.value not in ("on", "off"):
        print("batchgate: webhooks thin needs on or off", file=sys.stderr)
        return 2
    if problem := _usage_error(args):
        print(f"batchgate: {problem}", file=sys.stderr)
        return 2
    if (args.action == "enable") != (args.value is not None and args.action != "thin"):
        print("batchgate: " + ("webhooks enable needs the URL to allow again (as `webhooks disabled` lists it)"
                               if args.action == "enable" else f"webhooks {args.action} takes no value"),
              file=sys.stderr)
        return 2
    settings = _admin_settings(args)
    if args.action in ("disabled", "enable"):
        return _run_admin(settings, lambda: _disabled_urls(settings, args))

    async def main() -> int:
        redis = make_redis(settings.redis_url)
        # the default secret matters here: a tenant without its own signs with it, so rotate must keep it
        store = TenantStore(redis, Keys(settings.key_prefix), settings.webhook_secret, check_default=True)
        try:
            if args.action == "thin":
                await store.set(args.tenant, thin_callbacks=args.value == "on")
                print(f"tenant {args.tenant}: thin webhook payloads {args.value}")
                return 0
            if args.action == "rotate":
                print(await store.rotate_webhook_secret(args.tenant))
            elif args.action == "drop-old":
                await store.drop_old_webhook_secrets(args.tenant)
            secrets = await store.webhook_secrets(args.tenant)
            print("\n".join(f"{'signing' if i == 0 else 'also accepted'}: {s}" for i, s in enumerate(secrets)))
            await _warn_if_keyless(settings, store, args.tenant)
        except DefaultSecretUnknown as exc:
            print(f"batchgate: {exc}", file=sys.stderr)
            return 1
        finally:
            await redis.aclose()
        return 0

    return _run_admin(settings, main)


async def _disabled_urls(settings: Settings, args: argparse.Namespace) -> int:
    """`webhooks disabled` lists the URLs a tenant's receivers disabled with 410; `webhooks enable URL` allows
    one again (a 410 is final for the dispatcher; only the operator undoes it)."""
    from shared.callback_store import CallbackStore
    from shared.keys import Keys
    from shared.redis_io import make_redis

    redis = make_redis(settings.redis_url)
    try:
        store = CallbackStore(redis, Keys(settings.key_prefix))
        if args.action == "disabled":
            for url in await store.disabled(args.tenant):
                print(url)
            return 0
        if not await store.enable(args.tenant, args.value):
            print(f"batchgate: {args.value} is not disabled for tenant {args.tenant}", file=sys.stderr)
            return 1
        print(f"tenant {args.tenant}: {args.value} allowed again")
        return 0
    finally:
        await redis.aclose()


def _keys_usage_error(args: argparse.Namespace) -> str | None:
    if (args.action == "revoke") != (args.key is not None):
        return f"keys {args.action} " + ("needs the key, or its hash as `keys list` shows it"
                                         if args.action == "revoke" else "takes no key")
    return _usage_error(args)


def cmd_keys(args: argparse.Namespace) -> int:
    """Create, revoke or list API keys (stored hashed: a new key is printed once, never again)."""
    from shared.keys import Keys
    from shared.redis_io import make_redis
    from shared.tenants import TenantStore, key_digest

    if problem := _keys_usage_error(args):
        print(f"batchgate: {problem}", file=sys.stderr)
        return 2
    settings = _admin_settings(args)

    async def main() -> int:
        redis = make_redis(settings.redis_url)
        keys = Keys(settings.key_prefix)
        store = TenantStore(redis, keys)
        try:
            if args.action == "create":
                print(await store.create_key(args.tenant or "default"))
            elif args.action == "revoke":
                if args.tenant is not None:  # only that tenant's key: look it up before revoking anything
                    owner = await redis.get(keys.api_key(key_digest(args.key)))
                    if owner is not None and owner.decode() != args.tenant:
                        print(f"batchgate: that key belongs to tenant {owner.decode()}, not {args.tenant}; "
                              "nothing revoked", file=sys.stderr)
                        return 1
                tenant = await store.revoke_key(args.key)
                if tenant is None:
                    print("batchgate: no such key", file=sys.stderr)
                    return 1
                print(f"revoked a key of tenant {tenant}")
            elif args.tenant is not None:
                for digest in await store.list_keys(args.tenant):
                    print(digest)
            else:  # every tenant's keys: `TENANT HASH` lines (hashes only; keys are never stored)
                head, tail = keys.tenant_keys("\0").split("\0")
                tenants = sorted({raw.decode()[len(head):-len(tail)] async for raw in
                                  redis.scan_iter(match=keys.tenant_keys("*"))})
                for tenant in tenants:
                    for digest in await store.list_keys(tenant):
                        print(f"{tenant} {digest}")
            return 0
        finally:
            await redis.aclose()

    return _run_admin(settings, main)


def cmd_tenants(args: argparse.Namespace) -> int:
    """Per-tenant limits: submit rate, burst, backlog quota, thin webhook payloads."""
    from shared.keys import Keys
    from shared.redis_io import make_redis
    from shared.tenants import TenantStore

    if problem := _usage_error(args):
        print(f"batchgate: {problem}", file=sys.stderr)
        return 2
    settings = _admin_settings(args)

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
        print(json.dumps({"tenant": cfg.name, "rate_per_s": _finite(cfg.rate_per_s), "burst": cfg.burst,
                          "max_backlog": cfg.max_backlog, "thin_callbacks": cfg.thin_callbacks,
                          "webhook_secrets": len(cfg.webhook_secrets)}, allow_nan=False))
        await _warn_if_keyless(settings, store, args.tenant)
        await redis.aclose()

    return _run_admin(settings, main)


def cmd_up(args: argparse.Namespace) -> int:
    from batchgate.supervisor import run_stack

    environ = _environ(args)
    settings = Settings.from_environ(environ)
    _check_file_store(settings)  # here, not as a part's failure once started
    from shared.startup_checks import check_listen, check_model_cache, check_tokenizers

    if settings.port:  # a taken port now, before the models load (0 picks a free one); a race stays the supervisor's
        check_listen(_port_setting(args), settings.host, settings.port,
                     hint="choose another port (--port or BATCHGATE_PORT), or 0 for a free one",
                     host_setting="--host" if getattr(args, "host", None) else "BATCHGATE_HOST")
    check_model_cache(settings)
    check_tokenizers(settings)
    configure_logging(settings.log_level, settings.log_format)
    return run_stack(settings, environ)


class _AnyOrder(argparse.ArgumentParser):
    """A subcommand's parser that takes options and positionals in any order: `keys revoke --tenant T KEY` as
    well as `keys revoke KEY --tenant T` (plain argparse gives an optional positional up before an option)."""

    _intermixing = False

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if self._intermixing:  # parse_known_intermixed_args calls back here, twice
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


ADMIN_REDIS = ("The Redis: --redis-url, else BATCHGATE_REDIS_URL or REDIS_URL, else the running `batchgate up`'s; "
               "keys under BATCHGATE_KEY_PREFIX (default bg).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchgate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_AnyOrder)

    def common(p: argparse.ArgumentParser, serves: bool = True) -> None:
        p.add_argument("--config", help="YAML or TOML model config (else BATCHGATE_CONFIG, else built-ins)")
        p.add_argument("--models", help=f"comma-separated model names {'to serve' if serves else 'the gateways serve'} "
                                        "(else BATCHGATE_MODELS)")
        p.add_argument("--redis-url", help="Redis URL (else BATCHGATE_REDIS_URL or REDIS_URL)")

    def admin(p: argparse.ArgumentParser) -> None:  # the operations commands serve no models
        p.add_argument("--redis-url", help="Redis URL (else BATCHGATE_REDIS_URL or REDIS_URL, else the running "
                                           "`batchgate up`'s)")

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
    common(cb, serves=False)
    cb.set_defaults(func=cmd_callbacks)

    bt = sub.add_parser("batches", help="run a batch runner for the Batch API (several may run)")
    common(bt, serves=False)
    bt.set_defaults(func=cmd_batches)

    wh = sub.add_parser(
        "webhooks", help="a tenant's webhook signing secrets, payload form and disabled URLs",
        description="Show or change a tenant's webhooks: show the signing secrets; rotate (sign with a new one, "
                    "keep accepting the old); drop-old (end the overlap); thin on|off (payloads with ids only; "
                    "prints no secret); disabled (the URLs its receivers disabled with 410); enable URL (allow "
                    "one again). " + ADMIN_REDIS)
    admin(wh)
    wh.add_argument("action", choices=["show", "rotate", "drop-old", "thin", "disabled", "enable"],
                    help="what to do (above)")
    wh.add_argument("value", nargs="?", help="on|off for `thin`; the URL for `enable`")
    wh.add_argument("--tenant", default="default", help="the tenant (default: default)")
    wh.set_defaults(func=cmd_webhooks)

    ks = sub.add_parser(
        "keys", help="create, revoke or list API keys",
        description="API keys, stored hashed: create (a new key for the tenant, printed once, never again); "
                    "revoke KEY (the key, or its hash as `list` shows it; with --tenant, only if it is that "
                    "tenant's); list (the tenant's key hashes, or without --tenant every tenant's, one "
                    "`TENANT HASH` a line). " + ADMIN_REDIS)
    admin(ks)
    ks.add_argument("action", choices=["create", "revoke", "list"], help="what to do (above)")
    ks.add_argument("key", nargs="?", help="for revoke: the key, or its hash as `list` shows it")
    ks.add_argument("--tenant", default=None,
                    help="the tenant (default: default; `list` without it lists every tenant's key hashes)")
    ks.set_defaults(func=cmd_keys)

    ts = sub.add_parser(
        "tenants", help="show or set a tenant's limits",
        description="Show a tenant's limits, or set them (only the options given change), as JSON. A gateway "
                    "picks a change up within 5 s. " + ADMIN_REDIS)
    admin(ts)
    ts.add_argument("action", choices=["show", "set"], help="show, or set the options given")
    ts.add_argument("tenant", help="the tenant's name")
    ts.add_argument("--rate", type=float, help="submits per second (token bucket; 0: no rate limit)")
    ts.add_argument("--burst", type=int, help="bucket size: submits at once before the rate applies (>= 1)")
    ts.add_argument("--max-backlog", type=int, help="requests queued or running at once (0: no quota)")
    ts.add_argument("--thin-callbacks", choices=["on", "off"], help="webhook payloads with ids only")
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
    except RedisUnreachable as exc:
        print(exc, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
