"""`batchgate callbacks`: the webhook dispatcher, a deployable of its own (beside the gateway and the
workers; `run(settings)` below, or `python -m gateway.dispatcher`). Several can run; each delivery is
attempted by one.

    callback stream --XREADGROUP--> schedule (due set)  --claim (lease)--> attempt --> result
                                                           ^                             |
                                                           +---- retry with backoff -----+--> dead-letter

Per attempt: the URL is resolved and checked against the SSRF guard, the request goes to the checked
address (no second resolution), redirects are not followed, connect and total timeouts apply, and the
body is signed with Standard Webhooks headers (the same `webhook-id` on every attempt, a fresh
timestamp and signature each time). The schedule lives in Redis: a restart loses nothing and resets
nothing; a dispatcher that dies mid-attempt gives its delivery back when its lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis.asyncio as aioredis
import structlog
from prometheus_client import Counter, Histogram
from redis.exceptions import ResponseError

from shared.batch_store import BatchStore
from shared.batches import batch_object
from shared.callback_policy import backoff_s, classify, parse_retry_after
from shared.callback_store import GROUP, CallbackStore
from shared.codec import decode
from shared.config import Settings
from shared.errors import CodecError, ConfigError
from shared.keys import Keys
from shared.logs import configure_logging
from shared.messages import CallbackDelivery, CallbackState
from shared.records import RecordStore
from shared.redis_io import UNAVAILABLE, make_redis, raise_if_cancelling, until_reachable
from shared.ssrf import AllowList, RefusedURL, ResolveFailed, Resolver, Target, resolve_and_check, system_resolver
from shared.startup_checks import start_metrics_server
from shared.tenants import TenantStore
from shared.views import record_view
from shared.webhooks import sign_headers

log = structlog.get_logger(__name__)

ATTEMPTS = Counter("batchgate_webhook_attempts_total", "Webhook delivery attempts")
OUTCOMES = Counter("batchgate_webhook_outcomes_total", "Webhook attempts by outcome (delivered, retry: another attempt "
                   "follows, dead: the last attempt failed, failed, disabled)", ["outcome"])
FAILURES = Counter("batchgate_webhook_failures_total", "Failed webhook attempts by reason", ["reason"])
DEAD = Counter("batchgate_webhook_dead_letters_total", "Webhook deliveries that used up their attempts")
LATENCY = Histogram("batchgate_webhook_delivery_seconds", "Event to successful delivery",
                    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 7200))

CLAIM_BATCH = 100
MAX_IN_FLIGHT = 64
PER_HOST_IN_FLIGHT = 8
HOST_BUSY_DEFER_MS = 250
STREAM_RECLAIM_IDLE_MS = 30_000
EXPIRY_SWEEP_S = 1.0  # how often the overdue requests with a webhook are looked for
EXPIRY_BATCH = 200  # ... and at most this many expired a round
EXPIRY_RETRY_MS = 1_000  # a request not yet due by this dispatcher's reckoning is looked at again after this
EXPIRY_UNREADABLE_MS = 60_000  # ... and one whose record this build cannot read (it goes with its record's TTL)


def _destination(url: str) -> str:
    """The key that bounds attempts per destination: the URL's host name (lower-case) and port."""
    try:
        parts = urlsplit(url)
        return f"{(parts.hostname or '').lower().rstrip('.')}:{parts.port or ''}"
    except ValueError:
        return url


def _reason_label(reason: str) -> str:
    for key in ("timeout", "connect", "refused", "redirect"):
        if key in reason.lower():
            return key
    return reason.split(":")[0][:32]


class Dispatcher:
    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 resolver: Resolver = system_resolver, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 default_secret: str = "", max_in_flight: int = MAX_IN_FLIGHT,
                 per_host: int = PER_HOST_IN_FLIGHT) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.redis = redis or make_redis(settings.redis_url)
        self._own_redis = redis is None
        self.store = CallbackStore(self.redis, self.keys)
        # durable as the gateway's and workers' are: an `expired` this dispatcher writes is a result like theirs
        self.records = RecordStore(self.redis, self.keys, settings.result_ttl_s,
                                   wait_replicas=settings.redis_wait_replicas, wait_ms=settings.redis_wait_ms)
        self.tenants = TenantStore(self.redis, self.keys, default_secret)
        self.allow = AllowList.parse(settings.callback_allow)
        self.resolver = resolver
        self.clock = clock
        self.rng = rng or random.Random()
        self.name = settings.worker_name
        timeout = httpx.Timeout(settings.callback_timeout_s, connect=settings.callback_connect_timeout_s)
        # no keep-alive: a pooled TLS connection is keyed by the pinned IP, so it could be reused for another
        # host name behind the same address without that name's certificate being checked
        self.http = httpx.AsyncClient(
            timeout=timeout, follow_redirects=False, trust_env=False, transport=transport,
            limits=httpx.Limits(max_keepalive_connections=0),
            headers={"user-agent": "batchgate-webhooks/1", "content-type": "application/json"})
        self._wake = asyncio.Event()
        self.max_in_flight = max_in_flight  # attempts running at once, all destinations together
        self.per_host = per_host  # ... and to one destination (host name as written in the URL)
        self._in_flight: set[asyncio.Task[None]] = set()
        self._per_host: dict[str, int] = {}
        self.ready = asyncio.Event()

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def run(self, stop: asyncio.Event) -> None:
        async def start() -> None:
            await self._ensure_group()
            await self.tenants.announce_default_secret()  # so operations tools never sign past it (shared.tenants)

        started, _ = await until_reachable(start, stop, "callback dispatcher", log)
        if not started:  # stopped while waiting for Redis
            await self.http.aclose()
            if self._own_redis:
                await self.redis.aclose()
            return
        tasks = [asyncio.create_task(self._intake(), name="cb-intake"),
                 asyncio.create_task(self._deliver_due(), name="cb-due"),
                 asyncio.create_task(self._expire_overdue(), name="cb-expiry")]
        self.allow.log_effective(log, "dispatcher")
        self.ready.set()
        log.info("callback dispatcher ready", dispatcher=self.name)
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=10)
        # attempts still running are abandoned, leased: the next dispatcher makes them again after the lease
        attempts = list(self._in_flight)
        for t in attempts:
            t.cancel()
        if attempts:
            await asyncio.wait(attempts, timeout=10)
        await self.http.aclose()
        with contextlib.suppress(*UNAVAILABLE, ResponseError):
            await self.redis.xgroup_delconsumer(self.keys.callback_stream(), GROUP, self.name)
        if self._own_redis:
            await self.redis.aclose()

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.callback_stream(), GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # --- stream -> schedule --------------------------------------------------------------------
    async def _intake(self) -> None:
        stream = self.keys.callback_stream()
        backoff = 0.1
        while True:
            raise_if_cancelling()
            try:
                resp = await self.redis.xreadgroup(GROUP, self.name, {stream: ">"}, count=CLAIM_BATCH, block=1000)
                entries = [e for _, es in (resp or []) for e in es]
                reclaimed = await self.redis.xautoclaim(stream, GROUP, self.name, STREAM_RECLAIM_IDLE_MS,
                                                        start_id="0-0", count=CLAIM_BATCH)
                entries += [e for e in (reclaimed[1] if len(reclaimed) > 1 else []) if e[1]]
                await self._schedule_entries(stream, entries)
                backoff = 0.1
            except UNAVAILABLE as exc:
                raise_if_cancelling(exc)
                log.warning("dispatcher intake: redis unavailable", error=repr(exc))
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 5.0)
                continue
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    await self._ensure_group()
                    continue
                raise

    async def _schedule_entries(self, stream: str, entries: list[Any]) -> None:
        for entry_id, fields in entries:
            try:
                delivery = decode(fields[b"d"], CallbackDelivery)
            except (CodecError, KeyError) as exc:
                log.error("undecodable callback entry dropped", entry=entry_id, error=str(exc))
                await self.redis.xack(stream, GROUP, entry_id)
                continue
            await self.store.schedule(entry_id, delivery, self.now_ms())
        if entries:
            self._wake.set()

    # --- schedule -> attempts ------------------------------------------------------------------
    async def _deliver_due(self) -> None:
        """Claim due deliveries as slots free and start each at once, on its own: a slow receiver holds its own
        slots (at most `per_host` of them), never the loop, so it cannot delay other tenants' deliveries."""
        lease_ms = int(self.settings.callback_lease_s * 1000)
        while True:
            raise_if_cancelling()
            self._wake.clear()
            free = self.max_in_flight - len(self._in_flight)
            if free <= 0:  # every slot busy: the next finished attempt wakes us
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                continue
            try:
                ids = await self.store.claim_due(self.now_ms(), lease_ms, min(free, CLAIM_BATCH))
                if ids:
                    for i in ids:
                        task = asyncio.create_task(self._attempt_one(i), name=f"cb-attempt-{i}")
                        self._in_flight.add(task)
                        task.add_done_callback(self._attempt_done)
                    continue
                nxt = await self.store.next_due_ms()
            except UNAVAILABLE as exc:
                raise_if_cancelling(exc)
                log.warning("dispatcher: redis unavailable", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            # sleep until the next attempt is due or a new delivery arrives (capped: another dispatcher
            # may have scheduled something sooner)
            wait = 1.0 if nxt is None else min(1.0, max(0.0, (nxt - self.now_ms()) / 1000))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait)

    async def _expire_overdue(self) -> None:
        """Requests with a webhook whose deadline (plus the grace a worker gets) passed with no result are expired
        here, which queues their `completed` webhook. A worker expires what it reads and a caller's read expires
        what it reads; with no worker alive (scaled to zero, crashing) and a caller that only waits for the webhook,
        nothing else would. Every dispatcher sweeps: the first write wins, the others find the request ended."""
        key = self.keys.callback_deadlines()
        while True:
            raise_if_cancelling()
            try:
                raw = await self.redis.zrangebyscore(key, "-inf", self.now_ms(), start=0, num=EXPIRY_BATCH)
                due = [r.decode() if isinstance(r, bytes) else str(r) for r in raw]
                later = {rid: at for rid in due if (at := await self._expire_one(rid)) is not None}
                ended = [rid for rid in due if rid not in later]  # by this write or another, or gone
                if ended:
                    await self.redis.zrem(key, *ended)
                if later:
                    await self.redis.zadd(key, later)
                if len(ended) == EXPIRY_BATCH:
                    continue
                wait = await self._until_next_due(key)
            except UNAVAILABLE as exc:
                raise_if_cancelling(exc)
                log.warning("dispatcher: redis unavailable", error=repr(exc))
                wait = EXPIRY_SWEEP_S
            except Exception:  # the sweep outlives any one round's failure (the delivery loops go on regardless)
                log.exception("expiry sweep failed; trying again")
                wait = EXPIRY_SWEEP_S
            await asyncio.sleep(wait)

    async def _until_next_due(self, key: str) -> float:
        """Seconds until the earliest request in the list falls due, at most EXPIRY_SWEEP_S: what falls due is a
        time, and a request submitted meanwhile may fall due sooner (submits never pass through the dispatcher)."""
        head = await self.redis.zrange(key, 0, 0, withscores=True)
        if not head:
            return EXPIRY_SWEEP_S
        return min(EXPIRY_SWEEP_S, max(0.0, (head[0][1] - self.now_ms()) / 1000))

    async def _expire_one(self, request_id: str) -> int | None:
        """Expire one request if its deadline plus grace passed with no result. None when it has ended (now, by
        another write, or gone); else when to look at it again (ms): never dropped while it could still need this."""
        try:
            rec = await self.records.get(request_id)
        except CodecError as exc:  # a record this build cannot read (a newer writer's): a newer dispatcher's to end
            log.warning("expiry sweep: unreadable record skipped", request_id=request_id, error=repr(exc))
            return self.now_ms() + EXPIRY_UNREADABLE_MS
        if rec is None or rec.terminal:
            return None
        if rec.meta is None:  # its submit's pipeline is not all in yet: look again later
            return self.now_ms() + EXPIRY_RETRY_MS
        if await self.records.expire_overdue(rec, self.now_ms(), self.settings.expiry_grace_s, self.name):
            log.info("request expired with no worker to end it", request_id=request_id)
            return None
        due_ms = self.records.expiry_due_ms(rec.meta.deadline_ms, self.settings.expiry_grace_s) + 1
        return max(due_ms, self.now_ms() + EXPIRY_RETRY_MS)  # not due by this clock yet, or another write raced

    def _attempt_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.discard(task)
        self._wake.set()

    async def _attempt_one(self, delivery_id: str) -> None:
        """One delivery: whatever goes wrong stays with it (never stops the dispatcher). A Redis outage
        leaves it leased; it is attempted again when the lease runs out. A destination that already has
        `per_host` attempts running gets this one back on the schedule shortly (not an attempt: its count,
        state and webhook-id are unchanged), so a tarpit receiver cannot fill the dispatcher's slots."""
        host = ""
        try:
            loaded = await self.store.load(delivery_id)
            if loaded is None:
                await self.redis.zrem(self.keys.callback_due(), delivery_id)
                return
            delivery, state = loaded
            if state.status != "pending":
                await self.store.record(state, None)
                return
            host = _destination(delivery.url)
            if self._per_host.get(host, 0) >= self.per_host:
                await self.store.defer(delivery_id, self.now_ms() + HOST_BUSY_DEFER_MS)
                host = ""
                return
            self._per_host[host] = self._per_host.get(host, 0) + 1
            await self._attempt(delivery, state)
        except UNAVAILABLE as exc:
            raise_if_cancelling(exc)
            log.warning("webhook attempt interrupted by a redis outage", delivery=delivery_id, error=repr(exc))
        except Exception as exc:  # a bug or an impossible URL must not stop every other delivery
            log.exception("webhook attempt failed unexpectedly", delivery=delivery_id)
            with contextlib.suppress(Exception):
                loaded = await self.store.load(delivery_id)
                if loaded is not None:
                    await self._finish(loaded[0], replace(loaded[1], status="failed",
                                                          last_error=f"internal: {type(exc).__name__}: {exc}"))
        finally:
            if host:
                left = self._per_host.get(host, 1) - 1
                if left > 0:
                    self._per_host[host] = left
                else:
                    self._per_host.pop(host, None)

    async def _attempt(self, delivery: CallbackDelivery, state: CallbackState) -> None:
        attempt = state.attempts + 1
        if await self.store.is_disabled(delivery.tenant, delivery.url):
            await self._finish(delivery, replace(state, status="disabled", attempts=state.attempts,
                                                 last_error="this URL was disabled by an earlier 410"))
            return
        try:
            target = await asyncio.wait_for(
                asyncio.to_thread(resolve_and_check, delivery.url, self.allow, self.resolver),
                self.settings.callback_connect_timeout_s)
        except (ResolveFailed, TimeoutError) as exc:  # DNS trouble may pass: retry on the schedule
            await self._retry(delivery, state, attempt, None, f"resolve: {exc or 'timeout'}", None)
            return
        except RefusedURL as exc:
            FAILURES.labels("refused").inc()
            await self._finish(delivery, replace(state, status="failed", attempts=attempt,
                                                 last_error=f"refused: {exc}"))
            return
        body = await self._payload(delivery)
        secrets = await self.tenants.webhook_secrets(delivery.tenant)
        host = f"[{target.host}]" if ":" in target.host else target.host
        headers = {**sign_headers(secrets, delivery.delivery_id, body), "batchgate-event": delivery.event,
                   "host": host if target.port in (80, 443) else f"{host}:{target.port}"}
        ATTEMPTS.inc()
        code, retry_after, error = await self._post(target, body, headers)
        verdict = classify(code, error)
        # an attempt that would be retried but was the last is the delivery's dead letter, not a retry
        last = verdict.status == "retry" and attempt >= self.settings.callback_max_attempts
        OUTCOMES.labels("dead" if last else verdict.status).inc()
        now = self.now_ms()
        new = replace(state, attempts=attempt, last_status_code=code, last_error="" if code and code < 300 else
                      verdict.reason)
        if verdict.status == "delivered":
            LATENCY.observe(max(0.0, (now - delivery.created_ms) / 1000))
            await self._finish(delivery, replace(new, status="delivered", delivered_ms=now, next_attempt_ms=None))
        elif verdict.status == "disabled":
            await self.store.disable(delivery.tenant, delivery.url)
            await self._finish(delivery, replace(new, status="disabled", next_attempt_ms=None))
        elif verdict.status == "failed":
            FAILURES.labels(_reason_label(verdict.reason)).inc()
            await self._finish(delivery, replace(new, status="failed", next_attempt_ms=None))
        else:
            await self._retry(delivery, state, attempt, code, verdict.reason, retry_after)

    async def _retry(self, delivery: CallbackDelivery, state: CallbackState, attempt: int, code: int | None,
                     reason: str, retry_after: float | None) -> None:
        FAILURES.labels(_reason_label(reason)).inc()
        if attempt >= self.settings.callback_max_attempts:
            DEAD.inc()
            log.warning("webhook dead-lettered", delivery=delivery.delivery_id, attempts=attempt, reason=reason)
            await self._finish(delivery, replace(state, status="dead", attempts=attempt, last_status_code=code,
                                                 last_error=reason, next_attempt_ms=None), dead=True)
            return
        cap = self.settings.callback_cap_s
        delay = backoff_s(attempt, self.settings.callback_base_s, cap, self.rng,
                          min(retry_after, cap) if retry_after is not None else None)
        due = self.now_ms() + int(delay * 1000)
        new = replace(state, status="pending", attempts=attempt, last_status_code=code, last_error=reason,
                      next_attempt_ms=due)
        await self.store.record(new, due)
        await self.records.set_callback_state(delivery.request_id, new, self.now_ms())

    async def _finish(self, delivery: CallbackDelivery, state: CallbackState, dead: bool = False) -> None:
        await self.store.record(state, None, dead=dead)
        await self.records.set_callback_state(delivery.request_id, state, self.now_ms())

    async def _payload(self, delivery: CallbackDelivery) -> str:
        """The same JSON as GET /v1/requests/{id}, or ids only for tenants that asked for thin payloads."""
        thin = (await self.tenants.get(delivery.tenant)).thin_callbacks
        if delivery.request_id.startswith("batch_"):  # a batch's end: the batch object, as GET answers it
            st = None if thin else await BatchStore(self.redis, self.keys).get(delivery.request_id)
            body = batch_object(st.meta, st.progress) if st is not None else {
                "id": delivery.request_id, "event": delivery.event,
                "links": {"self": f"/v1/batches/{delivery.request_id}"}}
            return json.dumps(body, separators=(",", ":"))
        rec = None if thin else await self.records.get(delivery.request_id)
        if rec is None:
            payload: dict[str, Any] = {"id": delivery.request_id, "event": delivery.event,
                                       "links": {"self": f"/v1/requests/{delivery.request_id}"}}
        else:
            payload = record_view(rec)
            payload.pop("callback", None)
        return json.dumps(payload, separators=(",", ":"))

    async def _post(self, target: Target, body: str, headers: dict[str, str]) -> tuple[int | None, float | None, str]:
        host = f"[{target.ip}]" if ":" in target.ip else target.ip
        url = f"{target.scheme}://{host}:{target.port}{target.path}"
        ext = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            # the whole attempt is bounded (httpx's own timeouts are per phase, so a receiver trickling its
            # answer could hold it forever); the response body is never read
            async with asyncio.timeout(self.settings.callback_timeout_s), \
                    self.http.stream("POST", url, content=body.encode(), headers=headers, extensions=ext) as resp:
                return resp.status_code, parse_retry_after(resp.headers.get("retry-after")), ""
        except (httpx.TimeoutException, TimeoutError) as exc:
            return None, None, f"timeout ({type(exc).__name__})"
        except httpx.ConnectError as exc:
            return None, None, f"connect error ({type(exc).__name__})"
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # connected and sent (or sending): the receiver may have taken the webhook before the connection went
            return None, None, f"connection lost before an answer ({type(exc).__name__})"
        except httpx.HTTPError as exc:
            return None, None, f"transport error ({type(exc).__name__})"


# --- the deployable --------------------------------------------------------------------------------

async def _serve(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await Dispatcher(settings, default_secret=settings.webhook_secret).run(stop)


def run(settings: Settings, *, metrics_host: str = "127.0.0.1") -> None:
    """One dispatcher until SIGTERM/SIGINT; its /metrics on `settings.dispatcher_metrics_port` (0: none)."""
    if settings.dispatcher_metrics_port:  # a port it cannot have: a ConfigError, before anything starts
        start_metrics_server("BATCHGATE_DISPATCHER_METRICS_PORT", settings.dispatcher_metrics_port, metrics_host)
    asyncio.run(_serve(settings))


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway.dispatcher`: the same as `batchgate callbacks`, configured by the environment alone."""
    import argparse

    argparse.ArgumentParser(
        prog="python -m gateway.dispatcher",
        description="Run a webhook dispatcher (the same as `batchgate callbacks`; several may run). It takes no "
                    "arguments: it is configured by the environment (BATCHGATE_REDIS_URL, BATCHGATE_KEY_PREFIX, "
                    "BATCHGATE_WEBHOOK_SECRET, BATCHGATE_CALLBACK_*, ...; see the README).",
    ).parse_args(argv)  # --help, or an unknown argument (exit 2), before anything starts
    try:
        settings = Settings.from_environ()
        configure_logging(settings.log_level, settings.log_format)
        run(settings)
    except ConfigError as exc:
        print(f"batchgate callbacks: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
