"""The callers' side of the queue in Redis: admit, enqueue, read, wait on and cancel requests.

Used by the HTTP gateway (`gateway.service.GatewayService` adds API keys to it) and by the SDK's direct
mode, so both behave alike. No HTTP here.

Submit order: XADD the request to its lane stream, then write the queued record if none exists
yet, in one pipeline. The caller gets its id only after both succeeded, so an id it holds always
has a stream entry; a worker that finishes before the record exists simply creates it.

Round trips per submit: one under load, two at most. Admission needs the lane's length and the workers' load
figures. The figures are read at most every `STATS_CACHE_S` per process (workers publish them every 0.5 s, each
engine's refreshed every second; the submits arriving while one process reads them use its last ones, while those
are fresh). The
length comes back with every store (an XLEN after the XADD: the request's exact queue position), and a submit
within `LANE_LENGTH_CACHE_S` of the last one to the lane counts on it, plus the requests this process admitted
since; otherwise admission reads it first. Then the store pipeline. A
submit that waits for its result subscribes to the request's "done" channel before storing it
(`waiting`), so nothing can finish unseen and the record needs no read before the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared import admission
from shared.admission import Decision
from shared.callback_store import CallbackStore
from shared.coalesce import Coalescer
from shared.codec import decode_readable, encode
from shared.config import ModelSpec, Settings
from shared.idempotency import IdempotencyClaim, IdempotencyStore
from shared.keys import Keys
from shared.logs import get_logger
from shared.messages import ErrorInfo, InferenceRequest, LaneStats
from shared.records import RecordStore, StoredRecord, record_from_event
from shared.redis_io import make_redis
from shared.ssrf import AllowList
from shared.states import Priority, Status
from shared.tenant_limits import TenantLimits
from shared.token_limits import TokenLimits
from shared.waiters import Subscription, SubscriptionUnavailable, WaiterHub

# How long a process reuses the workers' load figures it read (they publish them every 0.5 s,
# gpu_worker.announce.STATS_INTERVAL_S): admission reads them at most this often.
STATS_CACHE_S = 0.1
# How long a process counts on the lane length its last store to the lane saw (plus what it admitted since) instead
# of reading it: under load every submit would otherwise pay a round trip for it; other processes' submits in this
# window are what admission does not see (at 2,000 submits/s, up to 100 requests, about as many as are in flight).
LANE_LENGTH_CACHE_S = 0.05
# An admission whose store has not returned counts as queued in the lane for at most this long (a request admitted
# and then not stored, an idempotency replay say, stops counting then).
ADMITTING_S = 1.0
# The socket timeout of a caller-facing client (gateway, SDK direct mode): no command it sends blocks in Redis, so
# one that has not answered in this long meets a Redis that is stopped or wedged (its 503 then comes this soon).
REQUEST_SOCKET_TIMEOUT_S = 3.0
# how long a cancel waits for the worker of a running request to stop it (at its next step: tens of ms; a
# prompt's whole prefill on a CPU: about a second) before it writes the cancelled record itself
CANCEL_GRACE_S = 2.0


@dataclass(slots=True)
class LaneLength:
    """A lane stream's length as this process last saw it, and the requests it admitted to the lane since."""

    at: float  # time.monotonic() of the read
    length: int
    admitted: int = 0


@dataclass(frozen=True, slots=True)
class Submitted:
    request: InferenceRequest
    queue_position: int
    decision: Decision
    created: bool = True  # this store wrote the queued record (False: one existed, a worker's or a retry's)


class Observer:
    """What the caller operations report; the gateway counts them (Prometheus), direct mode ignores them."""

    def submitted(self, req: InferenceRequest) -> None:
        """A request was accepted and stored."""

    def rejected(self, req: InferenceRequest, code: str) -> None:
        """Admission refused a request (`code`: backlog_full, deadline_infeasible)."""

    def cancelled(self, model: str) -> None:
        """A caller cancelled a request."""


def promised(req: InferenceRequest, decision: Decision) -> InferenceRequest:
    """The request as stored: with the start admission estimated for it, which the worker's scheduler ages it by."""
    if decision.estimate.basis != "stats":
        return req
    return dataclasses.replace(req, start_eta_ms=req.created_ms + round(decision.estimate.start_s * 1000))


class QueueClient:
    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 clock: Callable[[], float] = time.time, observer: Observer | None = None) -> None:
        self.settings = settings
        self.observer = observer or Observer()
        self.keys = Keys(settings.key_prefix)
        # a caller waits on these commands: a Redis that answers nothing is a 503 within seconds, not minutes
        # (durable writes wait up to `redis_wait_ms` for the replicas on top)
        self.redis = redis or make_redis(settings.redis_url, retry_timeouts=False,
                                         socket_timeout=REQUEST_SOCKET_TIMEOUT_S + settings.redis_wait_ms / 1000)
        self._own_redis = redis is None
        self.store = RecordStore(self.redis, self.keys, settings.result_ttl_s,
                                 wait_replicas=settings.redis_wait_replicas, wait_ms=settings.redis_wait_ms)
        self.hub = WaiterHub(self.redis, f"{settings.key_prefix}:hub")
        self.callbacks = CallbackStore(self.redis, self.keys)
        self.idempotency = IdempotencyStore(self.redis, self.keys, settings.result_ttl_s)
        self.limits = TenantLimits(self.redis, self.keys, default_rate_per_s=settings.tenant_rate_per_s,
                                   default_burst=settings.tenant_burst,
                                   default_max_backlog=settings.tenant_max_backlog, clock=clock)
        self.callback_allow = AllowList.parse(settings.callback_allow)
        self.token_limits = TokenLimits(settings.model_cache_dir)
        self.clock = clock
        self._stats: dict[str, tuple[float, list[LaneStats]]] = {}  # model -> (read at, monotonic; the figures)
        self._lengths: dict[str, LaneLength] = {}  # lane stream -> its length as last seen
        # lane stream -> when each request admitted to it and not stored yet was admitted: a burst's submits read
        # the lane's length concurrently, before any of them is stored, and each must count the others
        self._admitting: dict[str, deque[float]] = {}
        # (model, lane) -> what this process admitted and refused for deadlines lately (`admission.CONSISTENT_S`)
        self._recent: dict[tuple[str, str], tuple[admission.RecentAdmits, admission.RecentAdmits]] = {}
        self._submits: Coalescer[tuple[InferenceRequest, Decision], Submitted] = Coalescer(
            lambda items: self.submit_many(items))  # late-bound: the submits go wherever submit_many does

    async def start(self) -> None:
        self.callback_allow.log_effective(get_logger(__name__), "gateway")
        await self.hub.start()

    async def close(self) -> None:
        await self.hub.close()
        if self._own_redis:
            await self.redis.aclose()

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    async def load(self, model: str, lane: str) -> tuple[int, list[LaneStats]]:
        """The lane's stream length and the fresh per-worker stats of the model, in one round trip or none (the
        stats as read up to `STATS_CACHE_S` ago, the length as this process's last store to the lane returned it up
        to `LANE_LENGTH_CACHE_S` ago plus what it admitted since, when it has them that recent)."""
        stream = self.keys.lane_stream(model, lane)
        at = time.monotonic()
        cached = self._stats.get(model)
        seen = self._lengths.get(stream)
        if cached is not None and at - cached[0] < STATS_CACHE_S:
            if seen is not None and at - seen.at < LANE_LENGTH_CACHE_S:
                return seen.length + seen.admitted, admission.fresh(cached[1], self.now_ms())
            queued, stats = await self.redis.xlen(stream), cached[1]
        else:
            if cached is not None and cached[1] and len(admission.fresh(cached[1], self.now_ms())) == len(cached[1]):
                # the submits arriving while this one reads use the figures they have, while they are fresh: after
                # 5 s without a submit they are not, and a burst decided on them had no estimate (every request
                # admitted unchecked, and most expired in the queue: an outside probe); each reads its own then
                self._stats[model] = (at, cached[1])
            pipe = self.redis.pipeline(transaction=False)
            pipe.xlen(stream)
            pipe.hgetall(self.keys.lane_stats(model))
            queued, raw = await pipe.execute()
            stats = decode_readable(raw.values(), LaneStats)  # another schema version's figures do not count
            self._stats[model] = (at, stats)
        self._lengths[stream] = LaneLength(at, int(queued))
        return int(queued) + self._unstored(stream, at), admission.fresh(stats, self.now_ms())

    def _unstored(self, stream: str, at: float) -> int:
        """Requests this process admitted to the lane whose store has not returned (within `ADMITTING_S`)."""
        pending = self._admitting.get(stream)
        while pending and at - pending[0] > ADMITTING_S:
            pending.popleft()
        return len(pending) if pending else 0

    async def admit(self, req: InferenceRequest, spec: ModelSpec) -> tuple[Decision, int]:
        queued, stats = await self.load(req.model, req.lane)
        lane = spec.lane(req.lane)
        new_tokens = int(req.params.get("max_new_tokens", 0))
        prompt_tokens = max(1, req.est_tokens - new_tokens)
        est = admission.estimate(stats, req.lane, queued, prompt_tokens, new_tokens,
                                 (lane.window_ms if lane else 10.0) / 1000, lane.max_share if lane else 1.0,
                                 key=(Priority(req.priority).rank, req.deadline_ms), now_ms=self.now_ms())
        now, deadline_s = self.clock(), req.deadline_ms / 1000
        budget = deadline_s - now
        admitted, refused = self._recent.setdefault((req.model, req.lane), (admission.RecentAdmits(),
                                                                           admission.RecentAdmits()))
        near = spec.deadline_aware and admission.near_line(now_s=now, deadline_s=deadline_s, est=est)
        decision = admission.decide(now_s=now, deadline_s=deadline_s, est=est, queued=queued,
                                    max_backlog=lane.max_backlog if lane else 10_000,
                                    deadline_aware=spec.deadline_aware,
                                    larger_admitted=near and admitted.covers(now, prompt_tokens, new_tokens, budget),
                                    smaller_refused=near and refused.below(now, prompt_tokens, new_tokens, budget))
        if decision.accept and est.basis == "stats":
            admitted.note(now, prompt_tokens, new_tokens, budget)
        elif decision.code == "deadline_infeasible" and decision.retryable:
            refused.note(now, prompt_tokens, new_tokens, budget)
        stream = self.keys.lane_stream(req.model, req.lane)
        if decision.accept:
            self._admitting.setdefault(stream, deque()).append(time.monotonic())
            if (seen := self._lengths.get(stream)) is not None:
                seen.admitted += 1
        return decision, queued

    async def submit(self, req: InferenceRequest, decision: Decision) -> Submitted:
        """Store one request; the submits of one turn of the event loop share one pipeline (`Coalescer`)."""
        return await self._submits((req, decision))

    async def submit_many(self, items: list[tuple[InferenceRequest, Decision]]) -> list[Submitted]:
        """Store requests: per request, XADD to its lane stream, XLEN of the stream (its queue position: the
        entries waiting or running, itself included) and the queued record, in one pipeline."""
        pipe = self.redis.pipeline(transaction=False)
        now = self.now_ms()
        at = time.monotonic()
        streams = [self.keys.lane_stream(req.model, req.lane) for req, _ in items]
        lengths, inits = [], []
        items = [(promised(req, decision), decision) for req, decision in items]
        for (req, _), stream in zip(items, streams, strict=True):
            pipe.xadd(stream, {"m": encode(req)})
            lengths.append(len(pipe))
            pipe.xlen(stream)
            inits.append(len(pipe))  # the reply of the record's init: 1 if this call created it
            await self.store.init_in(pipe, req, now)
            if req.callback is not None:  # its webhook must go by its deadline, whoever is alive to expire it
                due = self.store.expiry_due_ms(req.deadline_ms, self.settings.expiry_grace_s)
                pipe.zadd(self.keys.callback_deadlines(), {req.id: due})
        try:
            replies = await self.store.execute_durably(pipe)  # with durable writes on, once the replicas have it
        finally:
            for stream in streams:  # stored (counted by the lane's length from now on), or failed
                if pending := self._admitting.get(stream):
                    pending.popleft()
        for stream, i in zip(streams, lengths, strict=True):
            self._lengths[stream] = LaneLength(at, int(replies[i]))
        return [Submitted(req, int(replies[i]), decision, replies[j] == 1)
                for (req, decision), i, j in zip(items, lengths, inits, strict=True)]

    async def idempotency_get(self, tenant: str, key: str) -> IdempotencyClaim | None:
        return await self.idempotency.get(tenant, key)

    async def idempotency_claim(self, tenant: str, key: str, claim: IdempotencyClaim) -> IdempotencyClaim | None:
        """Claim the key for `claim` (atomically: SET NX). None if claimed, else the existing claim."""
        return await self.idempotency.claim(tenant, key, claim)

    async def idempotency_takeover(self, tenant: str, key: str, old: IdempotencyClaim,
                                   new: IdempotencyClaim) -> bool:
        """Replace `old` with `new` only if the key still holds `old` (compare-and-set)."""
        return await self.idempotency.takeover(tenant, key, old, new)

    async def get(self, request_id: str) -> StoredRecord | None:
        """The record, expiring it first if its deadline (plus grace) passed with no result."""
        rec = await self.store.get(request_id)
        if rec is None or rec.terminal or rec.meta is None:
            return rec
        if not await self.store.expire_overdue(rec, self.now_ms(), self.settings.expiry_grace_s, "gateway"):
            return rec  # its deadline (plus the grace a worker gets to write a result) has not passed yet
        return await self.store.get(request_id)

    async def wait(self, request_id: str, timeout: float) -> StoredRecord | None:
        """Block until the record is terminal or `timeout` passes; woken by pub/sub, never by polling."""
        async with self.waiting(request_id) as sub:
            if sub is None:
                return await self.get(request_id)
            return await self.wait_on(sub, request_id, timeout)

    @contextlib.asynccontextmanager
    async def waiting(self, request_id: str) -> AsyncIterator[Subscription | None]:
        """Subscribed to the request's "done" channel (confirmed) for the block; None when the subscription
        cannot be had (then a caller reads the record once instead of waiting)."""
        await self.hub.ensure_started()
        entered = False
        try:
            async with self.hub.subscribe(self.keys.done_channel(request_id)) as sub:
                entered = True
                yield sub
        except SubscriptionUnavailable:
            if entered:
                raise
        else:
            return
        yield None

    async def wait_on(self, sub: Subscription, request_id: str, timeout: float,
                      stored: InferenceRequest | None = None) -> StoredRecord | None:
        """Wait on `sub` (from `waiting`) until the record is terminal or `timeout` passes. `stored`: the request,
        whose queued record this caller created after it subscribed (`Submitted.created`), so the record is
        queued or was changed with an event: it needs no read before the first wait."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        deadline_ms = stored.deadline_ms if stored is not None else None
        while True:
            if deadline_ms is None:  # the record its done event carried, else read back
                carried = sub.take_record()
                rec = (carried and record_from_event(request_id, carried)) or await self.get(request_id)
                if rec is None or rec.terminal:
                    return rec
                deadline_ms = rec.meta.deadline_ms if rec.meta is not None else None
            remaining = end - loop.time()
            if deadline_ms is not None:  # never wait past the point where get() would expire it
                expiry = (deadline_ms / 1000 + self.settings.expiry_grace_s) - self.clock()
                remaining = min(remaining, max(expiry, 0.0) + 0.05)
            if remaining <= 0 or (not await sub.wait(remaining) and loop.time() >= end) or sub.released:
                return await self.get(request_id)
            deadline_ms = None  # woken: read the record

    async def cancel(self, rec: StoredRecord) -> bool:
        """Cancel unless already terminal. True if the request ended cancelled by this call.

        A running request is asked of its worker first: it stops the row at its next step and writes the result
        with the output generated so far (what a streaming caller was sent, so the deltas still add up to the
        final output). Without an answer in `CANCEL_GRACE_S` (no live worker has it), or for a queued request,
        the cancelled record is written here, its output what its caller was streamed (none: no output)."""
        if rec.state is Status.RUNNING and rec.meta is not None:
            ended = await self._cancel_through_worker(rec)
            if ended is not None:
                return ended.state is Status.CANCELLED  # else it finished otherwise first
        return await self._cancelled_here(rec, "cancelled by the caller")

    async def cancel_queued(self, rec: StoredRecord, message: str) -> bool:
        """Cancel only while no worker has started it (atomically: a worker's start after this finds it ended and
        skips it; one before it leaves it running). True if the request ended cancelled by this call."""
        return await self._cancelled_here(rec, message, only_if=Status.QUEUED)

    async def _cancelled_here(self, rec: StoredRecord, message: str, only_if: Status | None = None) -> bool:
        won = await self.store.end_unanswered(rec, Status.CANCELLED, ErrorInfo("cancelled", message), self.now_ms(),
                                              "gateway", only_if=only_if)
        if won and rec.meta is not None:  # a worker holding it unstarted drops it; the tenant's quota is freed
            await self.redis.publish(self.keys.cancel_channel(rec.meta.model), rec.id)
            await self.redis.zrem(self.keys.tenant_active(rec.meta.tenant), rec.id)
        return won

    async def _cancel_through_worker(self, rec: StoredRecord) -> StoredRecord | None:
        """Publish the cancel to the model's workers and wait for the request's terminal record; None when it
        did not come within `CANCEL_GRACE_S`."""
        assert rec.meta is not None
        async with self.waiting(rec.id) as sub:
            await self.redis.publish(self.keys.cancel_channel(rec.meta.model), rec.id)
            if sub is None:
                return None
            ended = await self.wait_on(sub, rec.id, CANCEL_GRACE_S)
        return ended if ended is not None and ended.terminal else None

    async def backlog(self, model: str, lanes: tuple[str, ...]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for lane in lanes:
            pipe.xlen(self.keys.lane_stream(model, lane))
        counts = await pipe.execute()
        return {lane: int(n) for lane, n in zip(lanes, counts, strict=True)}

    async def ping(self) -> bool:
        return bool(await self.redis.ping())
